"""Hand-made path records (five lambdas, an LM and a ViT pair) for the tests of the pure figures."""

LAMBDAS = [0.0, 0.25, 0.5, 0.75, 1.0]


def lm_record(method="naive", loss=(2.0, 2.3, 2.6, 2.2, 1.9)):
    chord = [(1 - t) * loss[0] + t * loss[-1] for t in LAMBDAS]
    excess = [v - c for v, c in zip(loss, chord)]
    return {
        "method": method, "model_a": "lm-rope-s0", "model_b": "lm-rope-s1", "lambdas": LAMBDAS,
        "loss": list(loss), "accuracy": None, "barrier": max(excess), "midpoint_barrier": excess[2],
        "endpoint_loss_a": loss[0], "endpoint_loss_b": loss[-1], "accuracy_drop": None,
        "eval_set": "austen/test, 8,192 tokens (bytes), context 128", "eval_tokens": 8192,
    }


def vit_record(method="naive"):
    loss, acc = [0.2, 0.9, 1.6, 0.8, 0.25], [0.98, 0.7, 0.3, 0.75, 0.97]
    rec = lm_record(method, loss)
    rec.pop("eval_tokens")
    return {**rec, "model_a": "vit-rope-s0", "model_b": "vit-rope-s1", "accuracy": acc, "accuracy_drop": 0.675,
            "eval_set": "digits/test, 360 images", "eval_images": 360}
