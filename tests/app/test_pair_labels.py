"""The sidebar's pair labels name the width of a wider zoo pair and the dropout of a dropout-trained one, and only there."""

from app.sidebar import pair_label, pair_title


def test_a_wide_pair_is_labelled_with_its_width():
    assert pair_label("vit-learned-w128-s0", "vit-learned-w128-s1").endswith("· D 128 · seeds 0, 1")
    assert pair_title("vit-learned-w128-s0", "vit-learned-w128-s1").endswith(", D 128")
    assert "D " not in pair_label("vit-learned-s0", "vit-learned-s1")
    assert "D " not in pair_title("vit-learned-s0", "vit-learned-s1")


def test_a_dropout_pair_is_labelled_with_its_rate():
    assert pair_label("lm-learned-dropout-s0", "lm-learned-dropout-s1").endswith("· dropout 0.1 · seeds 0, 1")
    assert pair_title("lm-learned-dropout-s0", "lm-learned-dropout-s1").endswith(", dropout 0.1")
    assert "dropout" not in pair_label("lm-learned-s0", "lm-learned-s1")
    medium = ("lm-learned-medium-dropout-s0", "lm-learned-medium-dropout-s1")  # both: the tier, then the rate
    assert pair_label(*medium).endswith("· medium, 6 × 256 · dropout 0.1 · seeds 0, 1")
    assert pair_title(*medium).endswith(", medium, 6 × 256, dropout 0.1")
    assert "dropout" not in pair_label("lm-learned-medium-s0", "lm-learned-medium-s1")
