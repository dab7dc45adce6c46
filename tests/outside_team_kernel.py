"""An outside team's expert kernel, written from docs/PLUGGING_IN.md: plain torch, CPU only
(``GOOD``), and the same with a 1% error on experts with three or more routes (``BUGGY``, broken
on purpose). tests/test_fuzz_campaign.py copies this file into an empty directory and fuzzes it
from there, as ``magi-moe fuzz --impl team:GOOD`` would."""
import torch

from magi_moe.implementation import Implementation


def _swiglu7(g, u):
    g = g.clamp(max=7.0)
    u = u.clamp(-7.0, 7.0)
    return g * torch.sigmoid(1.702 * g) * (u + 1)


def _make_forward(bug: bool):
    def forward(x, table, weights, config, *, out):
        H, E, K, Dh = config.num_heads, config.num_experts, config.top_k, config.head_dim
        acc = torch.zeros(x.shape[0], H, K, Dh, dtype=torch.float32)
        xs = x.unflatten(1, (H, Dh))
        offsets = table.offsets.tolist()
        for f in range(H * E):
            lo, hi = offsets[f], offsets[f + 1]
            if hi == lo:
                continue
            h = f // E
            tokens = table.gather_ids[lo:hi].long()
            rows = xs[tokens, h].float()
            act = _swiglu7(rows @ weights.w_gate[f].float(), rows @ weights.w_up[f].float())
            if not (bug and hi - lo >= 3):  # the bug: experts with 3+ routes skip the rounding
                act = act.to(x.dtype).float()
            down = act @ weights.w_down[f].float()
            if bug and hi - lo >= 3:
                down = down * 1.01
            slots = table.route_slots[lo:hi]
            acc.view(-1, Dh)[slots] = down * table.sorted_probs[lo:hi, None].float()
        out.copy_(acc.sum(2).flatten(1).to(out.dtype))
        return out
    return forward


GOOD = Implementation("team-good", _make_forward(False), ("cpu",), "bf16-fp32acc",
                      dtypes=(torch.bfloat16, torch.float32), description="the team's kernel")
BUGGY = Implementation("team-buggy", _make_forward(True), ("cpu",), "bf16-fp32acc",
                       dtypes=(torch.bfloat16, torch.float32),
                       description="the team's kernel with a 1% error on busy experts")
