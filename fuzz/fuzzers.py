"""The fuzz properties, one :class:`Property` record each, in one registry: :data:`PROPERTIES`.

A record says all there is to say about a property: its name, its check (:mod:`fuzz.properties`),
the strategy its cases and parameters are drawn from (:mod:`fuzz.strategies`), what it runs on
(implementations on their backends, or routers), the capabilities it needs, and its share of the
loaded profile's examples (with any other Hypothesis settings). Everything else looks the
records up instead of branching on property names:

* ``tests/test_fuzz_properties.py``: one parametrized test, a row per property and
  implementation/backend pair or router (:func:`pytest_rows`, :func:`pytest_target`);
* the deliberately broken variants (``tests/test_fuzz_broken.py``): :func:`search`;
* ``python -m fuzz list``, the campaign's ``--properties``, ``python -m fuzz replay``
  (:func:`replay`).

Adding a property is one record (and its check)::

    Property("token_permutation", P.check_token_permutation, cases=expert(min_tokens=1),
             params={"perm_seed": SEEDS}, examples=0.5)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from hypothesis import given, settings as Settings, strategies as st

from magi_moe.audit.isolation import POISONS, ROUTE_MODES
from magi_moe.backends import plain_twin
from magi_moe.implementation import CAPABILITIES

from . import profiles
from . import properties as P
from .cases import ROUTER_KINDS
from .hypothesis_internals import set_database_key, set_given_settings
from .strategies import configs, empty_bank_sets, expert_cases, huge_cases, huge_configs, tie_cases, token_counts

__all__ = [
    "ON_IMPLEMENTATIONS", "ON_ROUTERS", "PROPERTIES", "ROUTERS", "SEEDS", "Property", "Router",
    "Subjects", "apply_row_settings", "campaign_target", "expert", "get_property", "pytest_rows",
    "pytest_target", "replay", "router_targets", "search",
]

SEEDS = st.integers(0, 2**32 - 1)


# -- what a property runs on -------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class Subjects:
    """What a property runs on: the record field that names it (``impl`` or ``router``) and how
    a replay loads it again from that name and a backend name."""

    name: str
    record_key: str
    load: Callable[[str, str], Any]
    default: str | None = None  # loaded when a record names none

    def coerce(self, target):
        """A target given by name (``package.module:attr`` or a registered name) runs on the CPU."""
        return self.load(target, "cpu") if isinstance(target, str) else target


ON_IMPLEMENTATIONS = Subjects("implementations", "impl", P.make_target)
ON_ROUTERS = Subjects("routers", "router", P.make_router_target, default="magi_moe.routing:route")


@dataclass(frozen=True)
class Router:
    """A router under test: a label for test ids, how to load it, the backends it runs on."""

    name: str
    spec: str
    backends: tuple[str, ...]


ROUTERS = (
    Router("torch", "magi_moe.routing:route", ("cpu", "cuda")),
    # with its table: the tie rule is also checked on the CSR table the fused router builds
    Router("fused", "magi_moe.kernels.router_choices:fused_routes_with_table", ("interpret", "cuda")),
)


def router_targets(backends=None) -> list[P.RouterTarget]:
    """Every router of :data:`ROUTERS` on each of its backends (those in ``backends`` if given)."""
    return [P.make_router_target(r.spec, b, name=r.name) for r in ROUTERS for b in r.backends
            if backends is None or b in backends]


# -- where the cases come from -----------------------------------------------------------------------
def expert(*, min_tokens: int = 0, min_heads: int = 1, empty_banks: bool = False):
    """Expert cases inside what the target declares (its dtypes, its shape rule), at least
    ``min_tokens`` tokens and ``min_heads`` heads, and with ``empty_banks`` some banks emptied
    by hand."""
    def cases(target, budget: float):
        declared = {} if target is None else {"dtypes": target.dtypes, "shapes": target.impl.shapes}
        return expert_cases(
            configs=configs(budget=budget, min_heads=min_heads, **declared),
            tokens=lambda config: token_counts(config, budget=budget, min_tokens=min_tokens),
            empty_banks=empty_bank_sets if empty_banks else False)
    return cases


def ties(target, budget: float):
    """Router inputs with exact ties, NaN rows and continuous values (whatever the router)."""
    return tie_cases(budget=budget, kinds=ROUTER_KINDS)


def router_inputs(target, budget: float):
    """The same router inputs, inside what the target implementation declares."""
    if target is None:
        return ties(target, budget)
    return tie_cases(configs=configs(budget=budget, dtypes=target.dtypes, shapes=target.impl.shapes),
                     kinds=ROUTER_KINDS)


def huge(target, budget: float):
    """Tokens past 2^31 / row stride, at widths inside the target's shape rule, in its dtypes."""
    declared = {} if target is None else {"shapes": target.impl.shapes, "dtypes": target.dtypes}
    return huge_cases(configs=huge_configs(**declared))


def _reruns(budget: float):
    """More reruns for larger budgets: 3 per commit."""
    return st.just(max(3, round(2 + budget)))


# -- the record --------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class Property:
    """One fuzz property.

    ``check(target, case, **params) -> metrics`` raises :class:`~fuzz.record.PropertyViolation`;
    ``cases(target, budget)`` is the strategy of its cases for a target (``None``: no target) at
    a size budget; ``params`` maps each keyword of the check to a strategy, or to a function of
    the budget returning one; ``on``: implementations or routers; ``needs``: capabilities an
    implementation must declare; ``kernels_only``: not the float64 oracle itself; ``examples``:
    its share of the loaded profile's ``max_examples`` (at least ``at_least``); ``settings``:
    other Hypothesis settings of its searches; ``clause``: the contract clause its failures
    count against in the verdict (:mod:`magi_moe.verdict`).
    """

    name: str
    check: Callable[..., dict]
    cases: Callable[[Any, float], st.SearchStrategy]
    params: Mapping[str, Any] = field(default_factory=dict)
    on: Subjects = ON_IMPLEMENTATIONS
    needs: tuple[str, ...] = ()
    kernels_only: bool = False
    examples: float = 1.0
    at_least: int = 2
    settings: Mapping[str, Any] = field(default_factory=dict)
    clause: str = "accuracy"  # the contract clause it judges (magi_moe.verdict)

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise ValueError(f"Property.name must be an identifier, got {self.name!r}")
        for what in ("check", "cases"):
            if not callable(getattr(self, what)):
                raise TypeError(f"Property {self.name}: {what} must be callable")
        if self.on not in (ON_IMPLEMENTATIONS, ON_ROUTERS):
            raise ValueError(f"Property {self.name}: on must be ON_IMPLEMENTATIONS or ON_ROUTERS")
        unknown = set(self.needs) - CAPABILITIES
        if unknown:
            raise ValueError(f"Property {self.name}: needs must be capabilities of {sorted(CAPABILITIES)}, "
                             f"got {sorted(unknown)}")
        from magi_moe.verdict import clause as known_clause

        known_clause(self.clause)  # ValueError naming the known clauses
        if not self.examples > 0 or self.at_least < 1:
            raise ValueError(f"Property {self.name}: examples must be > 0 and at_least >= 1, got "
                             f"{self.examples}, {self.at_least}")

    @property
    def summary(self) -> str:
        """The first sentence of the check's docstring."""
        doc = " ".join((self.check.__doc__ or "").split())
        return doc.split(": ")[0].split(". ")[0].rstrip(".")

    def strategy(self, target=None, *, budget: float = 1.0) -> st.SearchStrategy:
        """``(case, params)`` pairs for ``target`` at size ``budget``."""
        params = {k: v if isinstance(v, st.SearchStrategy) else v(budget) for k, v in self.params.items()}
        return st.tuples(self.cases(target, budget), st.fixed_dictionaries(params))

    def search_settings(self) -> Settings:
        """Its share of the loaded profile's examples, plus its own settings."""
        return Settings(profiles.examples(self.examples, at_least=self.at_least), **self.settings)

    def run(self, target, case, params: Mapping[str, Any]) -> dict:
        return self.check(target, case, **params)

    def target_of(self, record: Mapping[str, Any]):
        """The target a failure record names (``impl`` or ``router``, and ``backend``)."""
        spec = record.get(self.on.record_key) or self.on.default
        if spec is None:
            raise KeyError(f"a {self.name} record must name its {self.on.record_key}")
        return self.on.load(spec, record["backend"])


PROPERTIES: dict[str, Property] = {p.name: p for p in (
    # Each draws only cases where it can fail (fuzz.properties.TALLY counts the others).
    Property("differential", P.check_differential, cases=expert(min_tokens=1)),
    Property("tie_rule", P.check_tie_rule, cases=ties, on=ON_ROUTERS, examples=2.0,
             clause="routing"),
    # every implementation's own router (impl.route), judged like magi-moe's
    Property("routing", P.check_routing, cases=router_inputs, params={"head": st.integers(0, 63)},
             clause="routing"),
    Property("token_permutation", P.check_token_permutation, cases=expert(min_tokens=2),
             params={"perm_seed": SEEDS}, examples=0.5, clause="locality"),
    Property("head_locality", P.check_head_locality, cases=expert(min_tokens=1, min_heads=2),
             params={"head": st.integers(0, 63), "seed": SEEDS}, examples=0.5, clause="locality"),
    Property("linearity", P.check_linearity, cases=expert(min_tokens=1), examples=0.5,
             clause="locality"),
    Property("row_isolation", P.check_row_isolation, cases=expert(min_tokens=2),
             params={"poison": st.sampled_from(POISONS), "routes": st.sampled_from(ROUTE_MODES),
                     "form": st.sampled_from(("kernel", "layer")), "poison_seed": SEEDS,
                     "padding": st.booleans()},
             examples=0.5, clause="row-isolation"),
    Property("empty_experts", P.check_empty_experts, cases=expert(min_tokens=1, empty_banks=True),
             examples=0.75, clause="edge-shapes"),
    Property("zero_tokens", P.check_zero_tokens, cases=expert(), examples=0.25,
             clause="edge-shapes"),
    Property("deterministic", P.check_deterministic, cases=expert(min_tokens=1), params={"runs": _reruns},
             needs=("deterministic",), examples=0.34, clause="determinism"),
    # A child process per case (an int32 offset kills it): one case per commit.
    Property("huge_offsets", P.check_huge_offsets, cases=huge, needs=("int64_offsets",),
             kernels_only=True, examples=0.125, at_least=1, clause="int64-offsets"),
)}


def get_property(prop: str | Property) -> Property:
    if isinstance(prop, Property):
        return prop
    try:
        return PROPERTIES[prop]
    except (KeyError, TypeError):
        raise ValueError(f"prop must be one of {sorted(PROPERTIES)}, got {prop!r}") from None


def search(prop: str | Property, target, *, settings: Settings, budget: float = 1.0) -> None:
    """Run a Hypothesis search of ``prop`` on ``target`` (a target, or a name that loads on the
    CPU); raises the (shrunk) violation it finds."""
    prop = get_property(prop)
    target = prop.on.coerce(target)

    @settings
    @given(drawn=prop.strategy(target, budget=budget))
    def fuzz_one(drawn):
        case, params = drawn
        prop.run(target, case, params)

    fuzz_one()


def replay(record: Mapping[str, Any]) -> dict:
    """Run the check a record names on its target, case and parameters; raises on failure,
    and raises RuntimeError before any case when the record's backend is missing here."""
    from .cases import case_from_dict

    prop = PROPERTIES.get(record.get("property"))
    if prop is None:
        raise ValueError(f"record property must be one of {sorted(PROPERTIES)}, got {record.get('property')!r}")
    case = case_from_dict(record["case"])
    target = prop.target_of(record)
    why = target.skip_reason()
    if why:
        raise RuntimeError(f"cannot replay on backend {target.backend.name}: {why}")
    return prop.run(target, case, record.get("params", {}))


# -- pytest ------------------------------------------------------------------------------------------
def campaign_target(test=None, *, by_param: str | None = None):
    """Mark a test as a fuzz target of the campaign runner. Its property: the record held by
    its ``by_param`` parameter (the one property test), else its name without ``test_``."""
    def mark(fn):
        fn.fuzz_property = fn.__name__.removeprefix("test_")
        fn.fuzz_property_param = by_param
        return fn
    return mark if test is None else mark(test)


def pytest_rows(config) -> list:
    """A ``pytest.param(prop, subject)`` per property and what it runs on here: each selected
    implementation/backend pair (``--impl``, ``--backend``; a pair that cannot run is marked
    skip with the reason, as magi-moe's plugin marks its ``impl_backend`` rows), or each router
    on the selected backends. Ids: ``<property>-<impl or router>@<backend>``."""
    import pytest

    from magi_moe.pytest_plugin import impl_backend_params, selected_backends

    backends = {b.name for b in selected_backends(config)}
    rows = []
    for prop in PROPERTIES.values():
        if prop.on is ON_ROUTERS:
            for target in router_targets(backends):
                marks = [getattr(pytest.mark, target.backend.name)] if target.backend.marker else []
                why = target.skip_reason()
                if why:
                    marks.append(pytest.mark.skip(reason=why))
                marks.append(pytest.mark.clause(prop.clause))
                rows.append(pytest.param(prop, target, id=f"{prop.name}-{target}", marks=marks))
            continue
        for pair in impl_backend_params(config, needs=prop.needs, kernels_only=prop.kernels_only):
            rows.append(pytest.param(prop, *pair.values, id=f"{prop.name}-{pair.id}",
                                     marks=[*pair.marks, pytest.mark.clause(prop.clause)]))
    return rows


def apply_row_settings(test, prop: Property, nodeid: str) -> None:
    """Before one row of a parametrized ``@given`` test runs: its property's settings, and its
    own example-database key (the node id, as Hypothesis's pytest plugin keys rows of
    ``@pytest.mark.parametrize``), so rows neither share nor overwrite saved examples."""
    set_given_settings(test, prop.search_settings())
    set_database_key(test, nodeid.encode())


def pytest_target(subject, prop: str | Property):
    """The target of one test row (a router, or the Target of an ``impl_backend`` pair), or
    ``pytest.skip`` with the reason the property does not apply (the pair is missing, it would
    repeat ``@cpu``, a capability, the backend)."""
    import pytest

    prop = get_property(prop)
    if subject is None:
        pytest.skip("no implementation/backend pair selected")
    if isinstance(subject, P.RouterTarget):
        why = subject.skip_reason()
        if why:
            pytest.skip(why)
        return subject
    target = P.target_for(subject)
    twin = plain_twin(target.backend)
    if twin is not None and twin.name != target.backend.name and target.impl.plain_pytorch:
        pytest.skip(f"{target.impl.name} runs no Triton kernel: @{target.backend.name} would repeat @{twin.name}")
    why = target.skip_reason(prop.needs)
    if why:
        pytest.skip(why)
    return target
