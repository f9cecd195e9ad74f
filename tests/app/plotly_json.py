"""Reading charts back out of AppTest: plotly figure JSON with its typed arrays decoded, its path curves, and
the summary table under it."""

import base64
import json

import numpy as np


def decode_plotly(obj):
    """Undo plotly>=6 typed-array encoding ({'dtype','bdata','shape'}) recursively."""
    if isinstance(obj, dict):
        if "bdata" in obj and "dtype" in obj:
            arr = np.frombuffer(base64.b64decode(obj["bdata"]), dtype=obj["dtype"])
            if "shape" in obj:
                arr = arr.reshape([int(s) for s in str(obj["shape"]).split(",")])
            return arr
        return {k: decode_plotly(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode_plotly(v) for v in obj]
    return obj


def chart(at, key: str) -> dict:
    """The decoded plotly figure of the chart element with `key`."""
    return decode_plotly(json.loads(at.get_by_key(key).proto.spec))


def curves(fig: dict) -> dict[str, list[float]]:
    """Legend name -> y values of the path curves (chords and barrier bars carry no legend entry; the
    legend's key to chord and barrier is no curve)."""
    return {t["name"]: list(t["y"]) for t in fig["data"] if t.get("showlegend", True) and t.get("legendgroup") != "key"}


def summary(at) -> dict[str, dict]:
    """The table under the chart (the page's first dataframe), by curve name."""
    return {row["curve"]: row for row in at.dataframe[0].value.to_dict("records")}
