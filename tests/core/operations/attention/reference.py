"""Float64 NumPy attention: the independent reference every implementation is tested against.

Written from the conventions in ``workbench.core.operations.attention.common`` without
using any of its code.
"""

import numpy as np


def reference_attention(q, k, v, *, mask=None, bias=None, causal=False, sliding_window=None,
                        logits_soft_cap=None, q_segment_ids=None, kv_segment_ids=None, kv_lengths=None,
                        softmax_scale=None, sinks=None):
    """Output ``(B, T, H, D)`` and weights ``(B, H, T, S)``, float64, by explicit loops over heads.
    ``sinks (H,)``: one extra logit per head in every row's softmax, whose weight is dropped."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, t, h, d = q.shape
    s, kv = k.shape[1], k.shape[2]
    scale = 1 / np.sqrt(d) if softmax_scale is None else softmax_scale
    out = np.zeros((b, t, h, v.shape[-1]))  # the values' head dim (MLA: the latent's, not the keys')
    weights = np.zeros((b, h, t, s))
    full_mask = np.ones((b, h, t, s), bool) if mask is None else np.broadcast_to(np.asarray(mask, bool), (b, h, t, s))
    full_bias = np.zeros((b, h, t, s)) if bias is None else np.broadcast_to(np.asarray(bias, np.float64), (b, h, t, s))
    for bi in range(b):
        length = s if kv_lengths is None else int(kv_lengths[bi])
        for hi in range(h):
            kh = hi // (h // kv)  # query head hi reads kv head hi // group
            logits = scale * q[bi, :, hi] @ k[bi, :, kh].T
            if logits_soft_cap is not None:
                logits = logits_soft_cap * np.tanh(logits / logits_soft_cap)
            logits = logits + full_bias[bi, hi]
            for ti in range(t):
                p = length - t + ti  # bottom-right aligned position of query ti
                keys = np.arange(s)
                ok = full_mask[bi, hi, ti] & (keys < length)
                if causal or sliding_window is not None:
                    ok &= keys <= p
                if sliding_window is not None:
                    ok &= keys > p - sliding_window
                if q_segment_ids is not None:
                    ok &= np.asarray(kv_segment_ids)[bi] == np.asarray(q_segment_ids)[bi, ti]
                if not ok.any():
                    continue  # a query that sees nothing: zeros
                row = np.where(ok, logits[ti], -np.inf)
                if sinks is None:
                    e = np.exp(row - row[ok].max())
                    w = e / e.sum()
                else:
                    sink = float(np.asarray(sinks, np.float64)[hi])
                    top = max(row[ok].max(), sink)
                    e = np.exp(row - top)
                    w = e / (e.sum() + np.exp(sink - top))
                weights[bi, hi, ti] = w
                out[bi, ti, hi] = w @ v[bi, :, kh]
    return out, weights
