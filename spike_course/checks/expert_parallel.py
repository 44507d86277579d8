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
                                  "gets must be a token sent to it. See hint 2.")
            given[rank * per_rank + j] = sorted(found)
    return given


def _expected(reports, world, rule):
    """{expert: sorted list of (source rank, token)} that ``rule`` sends to each expert."""
    per_rank = reports[0]["per_rank"]
    want = {e: [] for e in range(world * per_rank)}
    for src in range(world):
        choice = reports[src]["choice"]
        for t, s in kept_assignments(choice, reports[src]["capacity"], world * per_rank, rule):
            want[int(choice[t, s])].append((src, t))
    return {e: sorted(v) for e, v in want.items()}


def _routing_mistake(reports, world) -> str | None:
    """What is wrong with the rows the experts were given, or None when each got exactly its own."""
    given = _given_to(reports, world)
    per_rank, capacity = reports[0]["per_rank"], reports[0]["capacity"]
    right = _expected(reports, world, "first choices first")
    if given == right:
        return None
    if not any(given.values()):
        return "no expert was given any row: the tokens were never dispatched to their experts. See hint 2."
    on_rank = lambda rows, d: sorted(r for e, v in rows.items() if e // per_rank == d for r in v)  # noqa: E731
    if all(on_rank(given, d) == on_rank(right, d) for d in range(world)):
        return ("the rows reach the right rank but the wrong expert on it: what arrives from each rank is "
                "grouped by expert, rank after rank, not all of one expert first. See hint 2.")
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
    e = next(e for e in right if given.get(e) != right[e])
    return (f"rows reach the wrong expert (expert {e} got {len(given.get(e, []))} rows, "
            f"{len(set(given.get(e, [])) & set(right[e]))} of them its own, of the {len(right[e])} routed to it): the "
            "rows sent and the counts sent are not in the same order, by expert and so by rank. See hint 2.")


def reference(reports, world):
    """The same layer in one process, from what the ranks reported: each rank's output and,
    after backward with their upstream gradients, the gradients of x, the gates and the experts."""
    import torch
    import torch.nn as nn

    per_rank, capacity = reports[0]["per_rank"], reports[0]["capacity"]
    dim = reports[0]["x"].shape[1]
    hidden = reports[0]["experts"][0]["0.weight"].shape[0]
    experts = []
    for rank in range(world):
        for state in reports[rank]["experts"]:
            mlp = nn.Sequential(nn.Linear(dim, hidden), nn.SiLU(), nn.Linear(hidden, dim)).double()
            mlp.load_state_dict(state)
            experts.append(mlp)
    out = {"x": [], "gate": [], "y": [], "dropped": [], "gated_dropped": [], "ungated": []}
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
            y = reports[rank]["y"]
            if y is None or y.shape != want["y"][rank].shape:
                raise CheckFailed(f"moe_forward on {world} ranks: rank {rank} returned "
                                  f"{None if y is None else tuple(y.shape)}, expected one row per token, "
                                  f"{tuple(want['y'][rank].shape)}.")
            if _close(y, want["y"][rank].detach(), n):
                continue
            for name, what in (("ungated", "the router's weights are not applied on the combine: the output is "
                                "the sum of the experts' results without their gates. See hint 3."),
                               ("dropped", "dropped tokens are counted twice: a dropped assignment adds "
                                "nothing here, because the residual connection around the layer already "
                                "carries its token. See hint 3."),
                               ("gated_dropped", "dropped tokens are counted twice: a dropped assignment adds "
                                "nothing here, not even its gate times the token, because the residual "
                                "connection around the layer already carries it. See hint 3.")):
                if _close(y, want[name][rank], n):
                    raise CheckFailed(f"moe_forward on {world} ranks: {what}")
            raise CheckFailed(f"moe_forward on {world} ranks: every expert was given exactly its rows, yet rank "
                              f"{rank}'s output differs from one process's by up to "
                              f"{(y - want['y'][rank]).abs().max().item():.3g}: the results do not go back to "
                              "their tokens' positions. See hint 3.")
        _check_gradients(reports, world, want, n)
    passed(f"moe_forward dispatches, drops and combines as one process does on "
           f"{', '.join(map(str, sorted(jobs)))} ranks, forward and backward")


def _check_gradients(reports, world, want, n) -> None:
    import torch

    per_rank = reports[0]["per_rank"]
    for rank in range(world):
        for name, what in (("grad_x", "the tokens x"), ("grad_gate", "the gates")):
            got = reports[rank][name]
            if got is None:
                raise CheckFailed(
                    f"moe_forward on {world} ranks: {what} got no gradient on rank {rank}: the graph is cut "
                    "between them and the output (rows moved with dist.* calls directly, which autograd "
                    "does not see, or a detached tensor). See hint 3.")
            if not _close(got, want[name][rank], n):
                raise CheckFailed(f"moe_forward on {world} ranks: the gradient of {what} on rank {rank} differs "
                                  "from one process's although the output matches. See hint 3.")
        for j, grads in enumerate(reports[rank]["grad_experts"]):
            for param, got in grads.items():
                got = torch.zeros_like(want["grad_experts"][rank * per_rank + j][param]) if got is None else got
                if not _close(got, want["grad_experts"][rank * per_rank + j][param], n):
                    raise CheckFailed(f"moe_forward on {world} ranks: expert {rank * per_rank + j}'s gradient "
                                      f"({param}) differs from one process's although the output matches. "
                                      "See hint 3.")
