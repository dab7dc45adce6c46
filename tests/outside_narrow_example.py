"""An outside implementation as many production kernels are: correct inside a narrow declared
rule, trusting its caller's route table, and raising on anything outside the rule.

It declares ``head_dim`` a multiple of 64, ``intermediate_size`` a multiple of 128, ``top_k`` at
most 4 and bfloat16 only, and does not declare ``input_checks``: it never validates the table.
The conformance suite must give it no failure (``tests/test_declarations_honoured.py``): any
check that calls it outside its rule, or holds it to input checks it never promised, shows as
a failure there.

    pytest --conformance --impl magi_moe.tests.outside_narrow_example:IMPL --backend cpu
"""
import torch

from magi_moe.implementation import Implementation, ShapeRule

RULE = ShapeRule(head_dim_multiple=64, intermediate_multiple=128, max_top_k=4)


def _refuse_outside_the_rule(x, config) -> None:
    """What a kernel with fixed tiles does: refuse widths its tiles do not cover."""
    why = RULE.reason(config)
    if why:
        raise ValueError(f"narrow-loop: {why}")
    if x.dtype != torch.bfloat16:
        raise ValueError(f"narrow-loop: x must be bfloat16, got {x.dtype}")


def narrow_forward(x, table, weights, config, *, out):
    """Per-expert loop over the CSR table, fp32 accumulation, SwiGLU7 rounded once to bf16,
    the top-k sum in fp32 in route order per (token, head), one final rounding."""
    _refuse_outside_the_rule(x, config)
    H, E, K, Dh = config.num_heads, config.num_experts, config.top_k, config.head_dim
    S = x.shape[0]
    offsets = table.offsets.tolist()
    acc = torch.zeros(S * H * K, Dh, dtype=torch.float32, device=x.device)  # one row per slot
    heads = x.unflatten(1, (H, Dh))
    for f in range(H * E):
        lo, hi = offsets[f], offsets[f + 1]
        if lo == hi:
            continue
        h = f // E
        rows = heads[table.gather_ids[lo:hi].long(), h].float()
        gate = (rows @ weights.w_gate[f].float()).clamp(max=7.0)
        up = (rows @ weights.w_up[f].float()).clamp(-7.0, 7.0)
        act = (gate * torch.sigmoid(1.702 * gate) * (up + 1)).to(torch.bfloat16).float()
        acc[table.route_slots[lo:hi]] = (act @ weights.w_down[f].float()) * table.sorted_probs[lo:hi, None]
    summed = acc.view(S, H, K, Dh).sum(dim=2)  # fixed order: k = 0, 1, ...; unrouted slots are 0
    out.copy_(summed.flatten(1).to(out.dtype))
    return out


IMPL = Implementation(
    name="narrow-loop",
    forward=narrow_forward,
    backends=("cpu",),
    precision="bf16-fp32acc",
    dtypes=(torch.bfloat16,),
    capabilities={"deterministic"},
    shapes=RULE,
    description="outside example: narrow shape rule, trusts its caller (tests only)",
)
