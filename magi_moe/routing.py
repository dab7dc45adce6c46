"""Routing (CONTRACT section 1 steps 1-5) and the CSR route table (CONTRACT section 2).

Tie rule: among equal selection scores the lower expert index wins and comes first. It is
implemented with a *stable* descending sort, which every torch device implements
identically, rather than ``torch.topk``, whose tie order differs between CPU and CUDA.

NaN policy: a NaN selection score ranks last (below -inf), and among NaNs the lower expert index
wins. This needs no host synchronisation, so the fast paths can share it; the layer rejects
non-finite router weights when they are loaded.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .config import MoEConfig
from .validation import check_contiguous, check_index_range, check_same_device, check_tensor

NORM_EPS = 1e-12  # F.normalize's eps for the L1 route normalisation


@dataclass(frozen=True)
class Routes:
    """Per token and head: chosen experts (ids within the head) and their probabilities.

    ``expert_ids`` int64 ``[S, H, K]``, highest selection score first; ``probs`` ``[S, H, K]``
    (fp32 for the production router, float64 for the reference router).
    """

    expert_ids: torch.Tensor
    probs: torch.Tensor


TABLE_FIELDS = ("gather_ids", "sorted_probs", "offsets", "route_slots")


def _compiling() -> bool:
    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and compiler.is_compiling())


@dataclass(frozen=True)
class RouteTable:
    """Routes sorted by flattened expert ``f = h*E + e``, stably (token order inside an expert).

    ``gather_ids`` int32 ``[R]``: token index of each route.
    ``sorted_probs`` ``[R]``: its routing weight, fp32 (float64 only from the reference router).
    ``offsets`` int64 ``[H*E + 1]``: routes of bank ``f`` are ``offsets[f]:offsets[f+1]``.
    ``route_slots`` int64 ``[R]``: position ``(s*H + h)*K + k`` of the route in ``[S, H, K]``;
    deterministic reductions store per-route results there.
    All four are dense (contiguous) and on one device.
    """

    gather_ids: torch.Tensor
    sorted_probs: torch.Tensor
    offsets: torch.Tensor
    route_slots: torch.Tensor
    num_tokens: int
    num_heads: int
    num_experts: int
    top_k: int
    # The four tensors' version counters when magi-moe's own builders (``build_route_table``,
    # the fused router) made the table, whose values are valid by construction: paths that
    # promise no host sync skip the value check for it. Not an init field, so hand-built tables
    # and ``dataclasses.replace`` copies start untrusted and get checked.
    _trusted_versions: tuple[tuple[int, int], ...] | None = field(default=None, init=False, compare=False,
                                                      repr=False)

    def mark_trusted(self) -> "RouteTable":
        """Vouch for the current values. Trust lasts while no tensor's version counter moves; a
        table of inference tensors (no version counter) cannot be watched and stays untrusted,
        and so does a table made inside ``torch.compile`` tracing (version counters are not
        values there): a caller that uses it in the same call skips the check on its own."""
        if _compiling():
            return self
        object.__setattr__(self, "_trusted_versions", self._versions())
        return self

    @property
    def trusted(self) -> bool:
        """True while the table is as a magi-moe builder made it: any in-place change to one of
        its tensors (``t.gather_ids[0] = 7``, ``add_``, ``copy_``, also under ``no_grad`` or
        inference mode) ends the trust. Four version reads, no device work."""
        versions = self._trusted_versions
        return versions is not None and self._versions() == versions

    def _versions(self) -> tuple[tuple[int, int], ...] | None:
        """(identity, version counter) of each tensor: a tensor swapped in behind the frozen
        dataclass's back changes the first, an in-place write the second."""
        try:
            return tuple((id(t), t._version) for t in (getattr(self, n) for n in TABLE_FIELDS))
        except (AttributeError, RuntimeError):  # not a tensor, or an inference tensor
            return None

    @property
    def num_routes(self) -> int:
        return self.gather_ids.numel()

    def counts(self) -> torch.Tensor:
        """Routes per bank, ``[H*E]`` int64."""
        return self.offsets[1:] - self.offsets[:-1]

    def select(self, keep: "int | torch.Tensor") -> "RouteTable":
        """The table of the routes ``keep`` names, still sorted by bank (token order inside one).

        ``keep`` is a prefix length (a Python int in ``[0, R]``), a boolean mask ``[R]``, or a
        1-D integer tensor of route positions in ``[0, R)`` (a set: order and repeats do not
        matter). A (token, head) whose routes all go has no route left: its output is zero.

        A prefix needs no host synchronisation: its offsets are the old ones clamped to the
        prefix length. Only a prefix of a trusted table stays trusted (it is valid by
        construction and is what a no-host-sync path cuts off, e.g. padded heads, whose banks
        sort last); a mask or index selection costs a host sync (its size, plus a range check
        for indices) and returns an untrusted table, whose values are then checked on use.
        """
        R = self.num_routes
        if isinstance(keep, int) and not isinstance(keep, bool):
            if not 0 <= keep <= R:
                raise ValueError(f"keep must lie in [0, {R}] as a prefix length, got {keep}")
            kept = self._with(self.gather_ids[:keep], self.sorted_probs[:keep],
                              self.offsets.clamp(max=keep), self.route_slots[:keep])
            return kept.mark_trusted() if self.trusted else kept
        mask = self._keep_mask(keep)
        # kept_before[i]: kept routes among the first i, so bank f's routes start at
        # kept_before[offsets[f]]; clamped so that garbage offsets of an untrusted table stay
        # in bounds (the result is untrusted and checked on use)
        kept_before = torch.zeros(R + 1, dtype=torch.int64, device=mask.device)
        torch.cumsum(mask, 0, out=kept_before[1:])
        offsets = kept_before[self.offsets.clamp(0, R)]
        return self._with(self.gather_ids[mask], self.sorted_probs[mask], offsets,
                          self.route_slots[mask])

    def _keep_mask(self, keep) -> torch.Tensor:
        R, device = self.num_routes, self.gather_ids.device
        if not isinstance(keep, torch.Tensor):
            raise TypeError(f"keep must be an int (prefix length), a boolean mask or an index "
                            f"tensor, got {type(keep).__name__}")
        if keep.dim() != 1 or keep.device != device:
            raise ValueError(f"keep must be a 1-D tensor on {device}, got shape "
                             f"{list(keep.shape)} on {keep.device}")
        if keep.dtype == torch.bool:
            if keep.numel() != R:
                raise ValueError(f"keep as a mask must have shape [{R}] (one entry per route), "
                                 f"got [{keep.numel()}]")
            return keep
        # uint8 is refused too: torch once read it as a mask, so 0/1 values would be ambiguous
        if keep.dtype.is_floating_point or keep.dtype.is_complex or keep.dtype == torch.uint8:
            raise TypeError(f"keep must be a boolean mask or an integer index tensor, got {keep.dtype}")
        if keep.numel():
            lo, hi = torch.stack([keep.min(), keep.max()]).tolist()
            check_index_range("keep as indices", lo, hi, R)
        mask = torch.zeros(R, dtype=torch.bool, device=device)
        mask[keep.long()] = True
        return mask

    TABLE_FIELDS = ("offsets", "gather_ids", "route_slots", "sorted_probs")

    def first_difference(self, other: "RouteTable") -> str | None:
        """Where this table's tensors first differ from ``other``'s (values compared on the CPU
        in ``other``'s dtypes, as ``torch.equal`` does: a NaN probability never matches), as
        one line naming the field and index; None when equal. For checks of a table a kernel
        built against :func:`build_route_table`'s."""
        for name in self.TABLE_FIELDS:
            a, b = getattr(self, name).cpu(), getattr(other, name).cpu()
            if a.shape != b.shape:
                return f"{name} has shape {tuple(a.shape)}, expected {tuple(b.shape)}"
            a = a.to(b.dtype)
            if not torch.equal(a, b):
                i = int((a != b).nonzero()[0, 0])
                return f"{name} differs first at index {i}: {a[i].item()!r}, expected {b[i].item()!r}"
        return None

    def _with(self, gather_ids, sorted_probs, offsets, route_slots) -> "RouteTable":
        return RouteTable(gather_ids, sorted_probs, offsets, route_slots, self.num_tokens,
                          self.num_heads, self.num_experts, self.top_k)

    def to(self, device: torch.device | str) -> "RouteTable":
        moved = self._with(self.gather_ids.to(device), self.sorted_probs.to(device),
                           self.offsets.to(device), self.route_slots.to(device))
        return moved.mark_trusted() if self.trusted else moved


def router_logits(x: torch.Tensor, gate: torch.Tensor, config: MoEConfig,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``l[s, h, e] = x[s, h, :] . gate[h*E + e, :]`` computed in ``dtype``; returns ``[S, H, E]``."""
    H, E, Dh = config.num_heads, config.num_experts, config.head_dim
    xh = x.reshape(x.shape[0], H, Dh).to(dtype)
    g = gate.reshape(H, E, Dh).to(dtype)
    return torch.einsum("shd,hed->she", xh, g)


def scores_from_logits(logits: torch.Tensor, score_func: str) -> torch.Tensor:
    """Scores from router logits. A NaN logit (a NaN gate row, CONTRACT section 1) gives a NaN
    score for that expert alone: softmax normalises over the head's other experts, as sigmoid
    scores each expert alone, so one bad expert ranks last instead of poisoning its whole head."""
    if score_func == "sigmoid":
        if logits.dtype == torch.float32 and logits.device.type == "cpu":
            # torch's CPU sigmoid takes one code path for a tensor's vectorised body and another
            # for its tail, an ulp apart (torch 2.13, AVX512: sigmoid(-18.625) at index 160 of
            # 165 differs from index 0), so equal logits got unequal scores by position and
            # exact ties broke the tie rule. Evaluated in float64 and rounded once, the scores
            # agree (but where the float64 results straddle an fp32 rounding midpoint).
            return torch.sigmoid(logits.double()).float()
        return torch.sigmoid(logits)
    if score_func == "softmax":
        nan = torch.isnan(logits)
        scores = torch.softmax(logits.masked_fill(nan, float("-inf")), dim=-1)
        return scores.masked_fill(nan, float("nan"))
    raise ValueError(f"score_func must be 'sigmoid' or 'softmax', got {score_func!r}")


def select_experts(selection: torch.Tensor, top_k: int) -> torch.Tensor:
    """Top-``k`` indices along the last dim, highest first, ties to the lower index, NaN last."""
    if not 1 <= top_k <= selection.shape[-1]:
        raise ValueError(f"top_k must lie in [1, {selection.shape[-1]}], got {top_k}")
    # Highest score first; the stable sort keeps the lower index first among equals. A second
    # stable sort on the NaN flag then moves NaNs below everything, -inf included.
    is_nan = torch.isnan(selection)
    key = torch.where(is_nan, torch.full_like(selection, float("-inf")), selection)
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices
    nan_last = torch.sort(torch.gather(is_nan, -1, order).to(torch.uint8), dim=-1, stable=True).indices
    order = torch.gather(order, -1, nan_last)
    return order[..., :top_k]


def route_probs(scores: torch.Tensor, expert_ids: torch.Tensor, config: MoEConfig) -> torch.Tensor:
    """Unbiased scores of the chosen experts, L1-normalised (with eps) if asked, times route_scale."""
    probs = torch.gather(scores, -1, expert_ids)
    if config.route_norm:
        probs = probs / probs.sum(dim=-1, keepdim=True).clamp_min(NORM_EPS)
    return probs * config.route_scale


def route(
    x: torch.Tensor,
    gate: torch.Tensor,
    bias: torch.Tensor | None,
    config: MoEConfig,
    *,
    dtype: torch.dtype = torch.float32,
) -> Routes:
    """Route ``x`` ``[S, H*Dh]`` with router ``gate`` ``[H*E, Dh]`` and selection ``bias`` ``[H*E]``.

    ``dtype`` is the router's working precision: fp32 as released, float64 for the reference.
    """
    H, E = config.num_heads, config.num_experts
    check_tensor("x", x, shape=(None, config.hidden_size))
    check_tensor("gate", gate, shape=(config.num_banks, config.head_dim))
    if bias is not None:
        check_tensor("bias", bias, shape=(config.num_banks,))
        check_same_device(x=x, gate=gate, bias=bias)
    else:
        check_same_device(x=x, gate=gate)
    logits = router_logits(x, gate, config, dtype)
    scores = scores_from_logits(logits, config.score_func)
    selection = scores if bias is None else scores + bias.reshape(H, E).to(dtype)
    expert_ids = select_experts(selection, config.top_k)
    return Routes(expert_ids=expert_ids, probs=route_probs(scores, expert_ids, config))


def check_routes(routes: Routes, config: MoEConfig) -> None:
    """Chosen experts in ``[0, E)`` and distinct per token and head (one sync): a route to a
    bank of another head, or one expert counted twice, would otherwise make a table that every
    path runs and that answers wrongly."""
    if not isinstance(routes, Routes):
        raise TypeError(f"routes must be a magi_moe.routing.Routes, got {type(routes).__name__}")
    H, E, K = config.num_heads, config.num_experts, config.top_k
    ids, probs = routes.expert_ids, routes.probs
    check_tensor("routes.expert_ids", ids, shape=(None, H, K), dtype=torch.int64)
    check_tensor("routes.probs", probs, shape=tuple(ids.shape), dtype=(torch.float32, torch.float64))
    check_same_device(expert_ids=ids, probs=probs)
    if ids.numel() == 0:
        return
    ranked = torch.sort(ids, dim=-1).values
    lo, hi, repeats = torch.stack([
        ids.min(), ids.max(), (ranked[..., 1:] == ranked[..., :-1]).sum(),
    ]).tolist()
    check_index_range("routes.expert_ids", lo, hi, E, "experts of one head")
    if repeats:
        raise ValueError(f"routes.expert_ids must name {K} distinct experts for every token and "
                         f"head, found {repeats} repeated choice(s)")


def build_route_table(routes: Routes, config: MoEConfig) -> RouteTable:
    """Sort routes by flattened expert, stably; empty experts get equal consecutive offsets.

    The routes are checked first (:func:`check_routes`, one sync): the table is marked trusted,
    so its values must be valid by construction."""
    check_routes(routes, config)
    ids, probs = routes.expert_ids, routes.probs
    H, E, K = config.num_heads, config.num_experts, config.top_k
    S = ids.shape[0]
    device = ids.device
    heads = torch.arange(H, device=device).view(1, H, 1)
    flat_expert = (ids + heads * E).reshape(-1)  # route r = (s*H + h)*K + k, in token order
    order = torch.sort(flat_expert, stable=True).indices
    counts = torch.bincount(flat_expert, minlength=H * E)
    offsets = torch.zeros(H * E + 1, dtype=torch.int64, device=device)
    torch.cumsum(counts, 0, out=offsets[1:])
    tokens = order // (H * K)
    return RouteTable(
        gather_ids=tokens.to(torch.int32),
        sorted_probs=probs.reshape(-1)[order],  # fp32 from the released router
        offsets=offsets,
        route_slots=order,
        num_tokens=S,
        num_heads=H,
        num_experts=E,
        top_k=K,
    ).mark_trusted()


def check_table_layout(table: RouteTable, config: MoEConfig) -> None:
    """What needs no device work: types, dtypes, shapes, density, one device, and that the table
    was built for ``config``. Strided views are refused: the kernels read the index tensors as
    dense memory, so a view with valid values would send them to other addresses."""
    if not isinstance(table, RouteTable):
        raise TypeError(f"table must be a magi_moe.routing.RouteTable, got {type(table).__name__}")
    for name in ("num_tokens", "num_heads", "num_experts", "top_k"):
        value = getattr(table, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"table.{name} must be an int >= 0, got {value!r}")
    if (table.num_heads, table.num_experts, table.top_k) != (
        config.num_heads, config.num_experts, config.top_k
    ):
        raise ValueError(
            f"table was built for H={table.num_heads} E={table.num_experts} K={table.top_k}, "
            f"config has H={config.num_heads} E={config.num_experts} K={config.top_k}"
        )
    check_tensor("table.gather_ids", table.gather_ids, shape=(None,), dtype=torch.int32)
    R = table.gather_ids.numel()
    check_tensor("table.sorted_probs", table.sorted_probs, shape=(R,),
                 dtype=(torch.float32, torch.float64))
    check_tensor("table.offsets", table.offsets, shape=(config.num_banks + 1,), dtype=torch.int64)
    check_tensor("table.route_slots", table.route_slots, shape=(R,), dtype=torch.int64)
    for name in TABLE_FIELDS:
        check_contiguous(f"table.{name}", getattr(table, name))
    check_same_device(gather_ids=table.gather_ids, sorted_probs=table.sorted_probs,
                      offsets=table.offsets, route_slots=table.route_slots)


def validate_route_table(table: RouteTable, config: MoEConfig, *, num_tokens: int | None = None) -> None:
    """Full check of a (possibly hand-built) route table: its layout, then its values, read in
    one host synchronisation (not for hot paths).

    Values: offsets start at 0, never decrease and end at the route count; token indices lie in
    ``[0, S)`` and route slots in ``[0, S*H*K)`` (the checks that keep a kernel in bounds);
    slots are distinct, each names the head of its route's bank and the token of its
    ``gather_ids`` entry (else a reduction adds a route into another output); weights are finite.
    Every value is computed without trusting the others, so garbage cannot fault the check."""
    check_table_layout(table, config)
    S = table.num_tokens if num_tokens is None else num_tokens
    if table.num_tokens != S:
        raise ValueError(f"table.num_tokens is {table.num_tokens}, input has {S} tokens")
    H, E, K = config.num_heads, config.num_experts, config.top_k
    R = table.num_routes
    offsets, tokens, slots = table.offsets, table.gather_ids.long(), table.route_slots
    stats = [offsets[0], offsets[-1], (offsets[1:] < offsets[:-1]).sum()]
    if R:
        repeated = _repeated_slots(slots, S * H * K)
        # the bank of route r if the offsets are valid (checked first): searchsorted only
        # compares, so garbage offsets give garbage banks, never a wild read
        route_ids = torch.arange(R, device=offsets.device)
        bank = torch.searchsorted(offsets, route_ids, right=True) - 1
        stats += [tokens.min(), tokens.max(), slots.min(), slots.max(),
                  repeated,
                  (torch.div(slots, K, rounding_mode="floor") % H
                   != torch.div(bank, E, rounding_mode="floor")).sum(),
                  (torch.div(slots, H * K, rounding_mode="floor") != tokens).sum(),
                  (~torch.isfinite(table.sorted_probs)).sum()]
    values = torch.stack([v.to(torch.int64) for v in stats]).tolist()
    first, last, decreasing = values[:3]
    if first != 0 or last != R:
        raise ValueError(f"table.offsets must start at 0 and end at the route count {R}, "
                         f"got {first} .. {last}")
    if decreasing:
        raise ValueError("table.offsets must be non-decreasing")
    if not R:
        return
    lo, hi, slot_lo, slot_hi, repeated, wrong_head, wrong_token, non_finite = values[3:]
    check_index_range("table.gather_ids", lo, hi, S)
    check_index_range("table.route_slots", slot_lo, slot_hi, S * H * K)
    if repeated:
        raise ValueError(f"table.route_slots must be distinct: {repeated} route(s) share an "
                         f"output slot with another")
    if wrong_head:
        raise ValueError(f"table.route_slots disagree with the banks' heads given by "
                         f"table.offsets ({wrong_head} route(s) name another head)")
    if wrong_token:
        raise ValueError(f"table.route_slots disagree with table.gather_ids (token index) for "
                         f"{wrong_token} route(s)")
    if non_finite:
        raise ValueError(f"table.sorted_probs must be finite, found {non_finite} non-finite weight(s)")


def _repeated_slots(slots: torch.Tensor, n_slots: int) -> torch.Tensor:
    """How many routes reuse a slot another route has, on the device. A count per slot (slots
    clamped, so out-of-range ones, refused separately, stay in bounds) when the slots are dense
    enough; a sort when the table is sparse in a huge token range (O(R) memory either way)."""
    R = slots.numel()
    if n_slots <= 8 * R:
        per_slot = torch.zeros(max(n_slots, 1), dtype=torch.int32, device=slots.device)
        per_slot.index_add_(0, slots.clamp(0, max(n_slots, 1) - 1),
                            torch.ones(R, dtype=torch.int32, device=slots.device))
        return R - (per_slot > 0).sum()
    ranked = torch.sort(slots).values
    return (ranked[1:] == ranked[:-1]).sum()
