"""Decides, for a whole model, which layers are sharded, how, and what stays replicated."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from torch import nn

from .attention import MultiheadAttentionRule
from .conv import Conv2dRule
from .embedding import EmbeddingRule
from .layer_plan import LayerPlan
from .layernorm import LayerNormRule
from .linear import LinearRule
from .rules import ShardRule, Unsupported
from .split import Split, Splitter

#: Every registration (module, attribute) of each parameter, by id: a tied one has several.
Registrations = dict[int, list[tuple[nn.Module, str]]]

RULES: tuple[ShardRule, ...] = (LinearRule(), EmbeddingRule(), Conv2dRule(), LayerNormRule(),
                                MultiheadAttentionRule())


def rule_for(module: nn.Module) -> ShardRule | None:
    """The rule for exactly this type: a subclass may have its own forward, which a rule would bypass."""
    for rule in RULES:
        if type(module) in rule.types:
            return rule
    return None


@dataclass
class PlannedLayer:
    name: str
    module: nn.Module
    rule: ShardRule
    plan: LayerPlan


@dataclass
class ModelPlan:
    layers: list[PlannedLayer] = field(default_factory=list)
    # module name -> (type name, why it is replicated), for modules owning replicated parameters
    replicated: dict[str, tuple[str, str]] = field(default_factory=dict)
    registrations: Registrations = field(default_factory=dict)


@dataclass(eq=False)
class _Candidate:
    name: str
    module: nn.Module
    rule: ShardRule
    claims: list[tuple[nn.Module, str]]


def plan_model(model: nn.Module, n_shards: int) -> ModelPlan:
    """Which layers of `model` are sharded over `n_shards`, how, and what stays replicated and why.

    Decided in four steps: the candidates (modules with a rule for their exact type),
    the tied parameters (every module registering one must shard it the same way, else
    none does), the cut of each layer, and the replicated rest.
    """
    registrations = _registrations(model)
    reasons: dict[int, str] = {}  # id(module) -> why it is not sharded
    candidates = _candidates(model, reasons)
    agreed = _agree_on_tied_parameters(candidates, registrations, reasons)
    plan = ModelPlan(registrations=registrations)
    splits = _plan_layers(candidates, agreed, Splitter(n_shards), plan, reasons)
    for name, module in model.named_modules():
        own = [p for p in module._parameters.values() if p is not None and id(p) not in splits]
        if own:
            plan.replicated[name] = (type(module).__name__, reasons.get(id(module), "no sharding rule for this type"))
    return plan


def _registrations(model: nn.Module) -> Registrations:
    registrations: Registrations = defaultdict(list)
    for module in model.modules():
        for pname, p in module._parameters.items():
            if p is not None:
                registrations[id(p)].append((module, pname))
    return dict(registrations)


def _candidates(model: nn.Module, reasons: dict[int, str]) -> list[_Candidate]:
    """Modules whose exact type has a rule and whose claimed parameters share one dtype and device."""
    candidates: list[_Candidate] = []
    covered: set[int] = set()  # submodules whose parameters a parent's rule shards (MHA's out_proj)
    for name, module in model.named_modules():
        if id(module) in covered:
            continue
        rule = rule_for(module)
        if rule is None:
            continue
        claims = rule.claimed(module)
        if not claims:
            continue
        dtypes = {(getattr(o, p).dtype, getattr(o, p).device) for o, p in claims}
        if len(dtypes) > 1:
            reasons[id(module)] = "parameters of mixed dtype or device"
            continue
        candidates.append(_Candidate(name, module, rule, claims))
        covered.update(id(o) for o, _ in claims if o is not module)
    return candidates


def _agree_on_tied_parameters(candidates: list[_Candidate], registrations: Registrations,
                              reasons: dict[int, str]) -> dict[int, int]:
    """The dimension each tied parameter is split along, by id; drops (from `candidates`)
    every candidate that shares a parameter it cannot shard the way the others do.

    A parameter can be sharded only if every module registering it shards it the same
    way; dropping one candidate can leave another alone with a parameter, so the check
    runs again until nothing changes.
    """
    agreed: dict[int, int] = {}
    changed = True
    while changed:
        changed = False
        claimants: dict[int, list[tuple[_Candidate, nn.Module, str]]] = defaultdict(list)
        for c in candidates:
            for owner, pname in c.claims:
                claimants[id(getattr(owner, pname))].append((c, owner, pname))
        for pid, users in claimants.items():
            if len(users) != len(registrations.get(pid, ())):
                why = "shares a parameter with a layer that is not sharded"
            elif len(users) > 1:
                dims = [set(c.rule.split_dims(c.module, o, p)) for c, o, p in users]
                common = set.intersection(*dims)
                if common:
                    prefer = users[0][0].rule.split_dims(users[0][0].module, users[0][1], users[0][2])
                    agreed[pid] = next(d for d in prefer if d in common)
                    continue
                why = "a tied parameter its users cannot split the same way"
            else:
                continue
            for c, _, _ in users:
                if c in candidates:
                    candidates.remove(c)
                    reasons[id(c.module)] = why
                    changed = True
        if changed:
            agreed.clear()
    return agreed


def _plan_layers(candidates: list[_Candidate], agreed: dict[int, int], splitter: Splitter, plan: ModelPlan,
                 reasons: dict[int, str]) -> dict[int, Split]:
    """Cut each candidate's parameters by its rule (a tied one once, along its agreed
    dimension) into `plan.layers`; returns every sharded parameter's Split, by id."""
    splits: dict[int, Split] = {}
    for c in candidates:
        fixed: dict[tuple[int, str], Split] = {}
        for owner, pname in c.claims:
            p = getattr(owner, pname)
            if id(p) not in splits and id(p) in agreed:
                splits[id(p)] = splitter.even(tuple(p.shape), agreed[id(p)])
            if id(p) in splits:
                fixed[(id(owner), pname)] = splits[id(p)]
        try:
            layer_plan = c.rule.plan(c.module, splitter, fixed)
        except Unsupported as e:
            if fixed:
                raise RuntimeError(f"layer {c.name!r} cannot shard its tied parameters: {e}") from e
            reasons[id(c.module)] = str(e)
            continue
        for sp in layer_plan.params:
            splits[id(getattr(sp.owner, sp.name))] = sp.split
        plan.layers.append(PlannedLayer(c.name, c.module, c.rule, layer_plan))
    return splits
