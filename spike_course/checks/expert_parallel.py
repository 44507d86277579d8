"""Exercise check for chapter 12, exercise 2: a mixture-of-experts layer's dispatch and combine
over the ranks (top-2 routing, several experts per rank, a capacity), forward and backward."""

from __future__ import annotations

from ._common import CheckFailed, launch_reports, passed

U = 2.0 ** -53  # float64's unit roundoff


def kept_assignments(choice, capacity, num_experts, rule="first choices first"):
    """The (token, slot) assignments of one rank that its experts accept under ``rule``:
    each expert takes the first ``capacity`` of them in priority order. The right rule visits
    every first choice, then every second choice, in token order; the others are the classic
    mistakes: "token order" (both choices of token 0, then token 1, ...), "no capacity" and
    "first choices only"."""
    tokens, top = choice.shape
    if rule == "token order":
        order = [(t, s) for t in range(tokens) for s in range(top)]
    else:
        order = [(t, s) for s in range(1 if rule == "first choices only" else top) for t in range(tokens)]
    taken, kept = [0] * num_experts, []
    for t, s in order:
        e = int(choice[t, s])
        if rule == "no capacity" or taken[e] < capacity:
            kept.append((t, s))
            taken[e] += 1
    return kept


def _given_to(reports, world):
    """{expert: sorted list of (source rank, token)} from the rows each expert recorded; a row
    that is no token's fails the check."""
    where = {tuple(row.tolist()): (src, t) for src in range(world) for t, row in enumerate(reports[src]["x"])}
    per_rank, given = reports[0]["per_rank"], {}
    for rank in range(world):
        for j, rows in enumerate(reports[rank]["given"]):
            found = [where.get(tuple(row.tolist())) for row in rows]
            if None in found:
                raise CheckFailed(f"expert {rank * per_rank + j} (rank {rank}) was given a row that is none of the "
                                  "tokens' (a row of zeros, or an empty buffer's leftovers?): every row an expert "
                                  "gets must be a token sent to it. See hint 3.")
            given[rank * per_rank + j] = sorted(found)
    return given


def _expected(reports, world, rule):
    """{expert: sorted list of (source rank, token)} that ``rule`` sends to each expert. "tokens
    out of step" keeps the right assignments but sends, for the i-th of them in priority order,
    the row of token i // 2: the expert ids laid out choice by choice, the token ids token by
    token."""
    per_rank = reports[0]["per_rank"]
    want = {e: [] for e in range(world * per_rank)}
    for src in range(world):
        choice = reports[src]["choice"]
        tokens, top = choice.shape
        out_of_step = rule == "tokens out of step"
        for t, s in kept_assignments(choice, reports[src]["capacity"], world * per_rank,
                                     "first choices first" if out_of_step else rule):
            sent = (s * tokens + t) // top if out_of_step else t  # the i-th in priority order is s * tokens + t
            want[int(choice[t, s])].append((src, sent))
    return {e: sorted(v) for e, v in want.items()}


def _on_rank(rows, per_rank, rank):
    """The rows of one rank's experts together, as a sorted list."""
    return sorted(r for e, v in rows.items() if e // per_rank == rank for r in v)


def _placement_mistake(given, right, world, per_rank) -> str | None:
    """The right assignments, sent to the wrong rank or the wrong expert on it (or None)."""
    if all(given[e] == _on_rank(right, per_rank, e // per_rank) for e in right):
        return ("each expert was given every row that came to its rank, its own and its neighbours': an "
                "expert runs on its own rows only (a real layer would pay the expert compute "
                f"{per_rank} times over). See hint 2.")
    ranks = [d for d in range(world) if _on_rank(given, per_rank, d) != _on_rank(right, per_rank, d)]
    if sorted(r for v in given.values() for r in v) == sorted(r for v in right.values() for r in v):
        if not ranks:
            return ("the rows reach the right rank but the wrong expert on it: rows from every rank arrive "
                    "mixed, for any of its experts, and a row alone does not say which. See hint 1.")
        return (f"rows reach the wrong rank: rank {ranks[0]}'s experts were given rows routed to experts "
                f"of other ranks. Expert e lives on rank e // {per_rank}, as its experts[e % {per_rank}]. "
                "See hint 1.")
    starved = [e for e in right if right[e] and not given[e]]
    if starved and min(starved) >= per_rank and all(given[e] == right[e] for e in right if e not in starved):
        return (f"experts {starved} were given none of the rows routed to them, while the others got exactly "
                "theirs: a global expert id was compared with an index into `experts`. On rank 0 the two "
                "are the same number, on the other ranks they are not. See hint 1.")
    return None


def _selection_mistake(given, reports, world) -> str | None:
    """The wrong assignments accepted, or the wrong rows sent for them (or None)."""
    capacity = reports[0]["capacity"]
    over = [(e, src) for e, rows in given.items() for src in range(world)
            if sum(1 for s, _ in rows if s == src) > capacity]
    if given == _expected(reports, world, "no capacity") or over:
        e, src = over[0] if over else (0, 0)
        return (f"the capacity is not applied: expert {e} was given more than {capacity} of rank {src}'s tokens. "
                "Each expert accepts at most `capacity` of a rank's assignments; the rest are dropped "
                "before the dispatch. See hint 1.")
    if given == _expected(reports, world, "token order"):
        return ("the wrong assignments are dropped: the experts kept them in token order (both choices of "
                "token 0, then token 1, ...). First choices come before every second choice. See hint 1.")
    if given == _expected(reports, world, "first choices only"):
        return "the second choices are ignored: every token goes to its top 2 experts. See hint 1."
    if given == _expected(reports, world, "tokens out of step"):
        return ("each expert was given as many rows as it accepted, but the wrong tokens: the token ids are "
                "laid out token by token (0, 0, 1, 1, ...), the experts choice by choice, so the i-th row "
                "sent is not the i-th assignment's token. See hint 2.")
    return None


def _routing_mistake(reports, world) -> str | None:
    """What is wrong with the rows the experts were given, or None when each got exactly its own."""
    given = _given_to(reports, world)
    right = _expected(reports, world, "first choices first")
    if given == right:
        return None
    if not any(given.values()):
        return "no expert was given any row: the tokens were never dispatched to their experts. See hint 3."
    mistake = (_placement_mistake(given, right, world, reports[0]["per_rank"])
               or _selection_mistake(given, reports, world))
    if mistake:
        return mistake
    e = next(e for e in right if given.get(e) != right[e])
    return (f"rows reach the wrong expert (expert {e} got {len(given.get(e, []))} rows, "
            f"{len(set(given.get(e, [])) & set(right[e]))} of them its own, of the {len(right[e])} routed to it): "
            "each accepted assignment sends its token's row to its expert. See hint 1.")


def reference(reports, world):
    """The same layer in one process, from what the ranks reported: each rank's output and,
    after backward with their upstream gradients, the gradients of x, the gates and the experts."""
    import torch
    import torch.nn as nn

    capacity = reports[0]["capacity"]
    dim = reports[0]["x"].shape[1]
    hidden = reports[0]["experts"][0]["0.weight"].shape[0]
    experts = []
    for rank in range(world):
        for state in reports[rank]["experts"]:
            mlp = nn.Sequential(nn.Linear(dim, hidden), nn.SiLU(), nn.Linear(hidden, dim)).double()
            mlp.load_state_dict(state)
            experts.append(mlp)
    out = {"x": [], "gate": [], "y": [], "dropped": [], "gated_dropped": [], "ungated": [], "accepted": []}
    loss = 0
    for src in range(world):
        got = reports[src]
        x, gate = got["x"].clone().requires_grad_(), got["gate"].clone().requires_grad_()
        kept = kept_assignments(got["choice"], capacity, len(experts))
        y, ungated = torch.zeros_like(x), torch.zeros_like(x)
        for t, s in kept:
            result = experts[int(got["choice"][t, s])](x[t:t + 1])[0]
            y = y.index_add(0, torch.tensor([t]), (gate[t, s] * result)[None])
            ungated = ungated.index_add(0, torch.tensor([t]), result[None].detach())
        lost = [(t, s) for t in range(len(x)) for s in range(gate.shape[1]) if (t, s) not in kept]
        count = torch.zeros(len(x), dtype=torch.float64)
        weight = torch.zeros(len(x), dtype=torch.float64)
        for t, s in lost:
            count[t] += 1
            weight[t] += gate[t, s].item()
        out["accepted"].append(torch.bincount(torch.tensor([t for t, _ in kept], dtype=torch.long),
                                              minlength=len(x)))
        loss = loss + (y * got["grad_out"]).sum()
        for name, value in (("x", x), ("gate", gate), ("y", y), ("ungated", ungated),
                            ("dropped", y.detach() + count[:, None] * x.detach()),
                            ("gated_dropped", y.detach() + weight[:, None] * x.detach())):
            out[name].append(value)
    loss.backward()
    out["grad_x"] = [x.grad for x in out["x"]]
    out["grad_gate"] = [g.grad for g in out["gate"]]
    # an expert given no row has no gradient: zeros, as a rank whose expert ran on 0 rows has
    out["grad_experts"] = [{n: torch.zeros_like(p) if p.grad is None else p.grad for n, p in e.named_parameters()}
                           for e in experts]
    return out


def _close(got, want, n) -> bool:
    """Within the rounding of sums of up to n terms, as the lecture derived it: 10 x 2 n u x the
    size of the compared tensor (the ranks add in other orders, and batch other rows)."""
    import torch

    if got is None or got.shape != want.shape:
        return False
    return bool(torch.isfinite(got).all()) and (got - want).abs().max().item() <= 10 * 2 * n * U * want.abs().max().item()


def check_moe_layer(jobs: dict) -> None:
    """Check moe_forward through ``jobs``: {world size: the launch of moe_check.py with
    check=False}. Each expert must be given exactly the rows its capacity accepts; each rank's
    output and its gradients (x, the gates, the experts) must match one process's layer."""
    for world, job in sorted(jobs.items()):
        reports = launch_reports(job, "moe_forward")
        mistake = _routing_mistake(reports, world)
        if mistake:
            raise CheckFailed(f"moe_forward on {world} ranks: {mistake}")
        want = reference(reports, world)
        tokens, dim = reports[0]["x"].shape
        n = world * tokens + dim + reports[0]["experts"][0]["0.weight"].shape[0]
        for rank in range(world):
            mistake = _output_mistake(reports[rank]["y"], want, rank, n)
            if mistake:
                raise CheckFailed(f"moe_forward on {world} ranks: {mistake}")
        _check_gradients(reports, world, want, n)
    passed(f"moe_forward dispatches, drops and combines as one process does on "
           f"{', '.join(map(str, sorted(jobs)))} ranks, forward and backward")


# What an output that one process's layer does not give matches instead, and the mistake that makes it
WRONG_OUTPUTS = (
    ("ungated", "the router's weights are not applied on the combine: the output is the sum of the "
                "experts' results without their gates. See hint 1."),
    ("dropped", "dropped tokens are counted twice: a dropped assignment adds nothing here, because the "
                "residual connection around the layer already carries its token. See hint 1."),
    ("gated_dropped", "dropped tokens are counted twice: a dropped assignment adds nothing here, not even "
                      "its gate times the token, because the residual connection around the layer already "
                      "carries it. See hint 1."),
)


def _output_mistake(y, want, rank, n) -> str | None:
    """What is wrong with rank ``rank``'s output y, given that every expert got exactly its rows
    (or None when it matches one process's)."""
    right = want["y"][rank].detach()
    if y is None or y.shape != right.shape:
        return (f"rank {rank} returned {None if y is None else tuple(y.shape)}, expected one row per token, "
                f"{tuple(right.shape)}.")
    if _close(y, right, n):
        return None
    for name, mistake in WRONG_OUTPUTS:
        if _close(y, want[name][rank], n):
            return mistake
    twice = want["accepted"][rank] == 2
    if twice.any() and _close(y[~twice], right[~twice], n):
        return (f"the {int(twice.sum())} tokens of rank {rank} with both assignments accepted are wrong, the "
                "others right: one of a token's two results took the place of the other instead of adding "
                "to it. See hint 2.")
    return (f"every expert was given exactly its rows, yet rank {rank}'s output differs from one process's "
            f"by up to {(y - right).abs().max().item():.3g}: the results do not go back to their tokens' "
            "positions. See hint 1.")


def _check_gradients(reports, world, want, n) -> None:
    import torch

    per_rank = reports[0]["per_rank"]
    for rank in range(world):
        for name, what in (("grad_x", "the tokens x"), ("grad_gate", "the gates")):
            got = reports[rank][name]
            if got is None:
                raise CheckFailed(
                    f"moe_forward on {world} ranks: {what} got no gradient on rank {rank}: the graph is cut "
                    "between them and the output (a value taken out with .item() or .tolist(), rows moved "
                    "with dist.* calls that autograd does not see, or a detached tensor). See hint 2.")
            if not _close(got, want[name][rank], n):
                raise CheckFailed(f"moe_forward on {world} ranks: the gradient of {what} on rank {rank} differs "
                                  "from one process's although the output matches. See hint 2.")
        for j, grads in enumerate(reports[rank]["grad_experts"]):
            for param, got in grads.items():
                got = torch.zeros_like(want["grad_experts"][rank * per_rank + j][param]) if got is None else got
                if not _close(got, want["grad_experts"][rank * per_rank + j][param], n):
                    raise CheckFailed(f"moe_forward on {world} ranks: expert {rank * per_rank + j}'s gradient "
                                      f"({param}) differs from one process's although the output matches. "
                                      "See hint 2.")
