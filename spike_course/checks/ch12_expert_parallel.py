"""Exercise check for chapter 12, exercise 2: a mixture-of-experts layer's dispatch and combine
over the ranks (top-2 routing, several experts per rank, a capacity), forward and backward."""

from __future__ import annotations

from ._common import CheckFailed, Mistake, launch_reports, name_the_first, passed

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


class _Routing:
    """The rows each expert was given (``given``) against those it should have been (``right``),
    both {expert: sorted (source rank, token)}, on ``world`` ranks of ``per_rank`` experts."""

    def __init__(self, reports, world):
        self.reports, self.world, self.per_rank = reports, world, reports[0]["per_rank"]
        self.capacity = reports[0]["capacity"]
        self.given, self.right = _given_to(reports, world), _expected(reports, world, "first choices first")

    def given_by(self, rule) -> bool:
        """Whether the experts were given what ``rule`` (one of kept_assignments') sends them."""
        return self.given == _expected(self.reports, self.world, rule)

    @property
    def same_rows(self) -> bool:
        """The right rows were sent, to whichever expert."""
        return sorted(r for v in self.given.values() for r in v) == sorted(r for v in self.right.values() for r in v)

    @property
    def wrong_ranks(self) -> list[int]:
        return [d for d in range(self.world)
                if _on_rank(self.given, self.per_rank, d) != _on_rank(self.right, self.per_rank, d)]

    @property
    def starved(self) -> list[int]:
        """The experts given none of their rows, where every other expert got exactly its own."""
        starved = [e for e in self.right if self.right[e] and not self.given[e]]
        others_right = all(self.given[e] == self.right[e] for e in self.right if e not in starved)
        return starved if starved and min(starved) >= self.per_rank and others_right else []

    @property
    def over_capacity(self) -> list[tuple[int, int]]:
        """(expert, source rank) pairs where the expert took more than its capacity of the rank's tokens."""
        return [(e, src) for e, rows in self.given.items() for src in range(self.world)
                if sum(1 for s, _ in rows if s == src) > self.capacity]


# What is wrong with the rows the experts were given: where they went, then which were sent.
ROUTING_MISTAKES = (
    Mistake("nothing dispatched", lambda r: not any(r.given.values()),
            "no expert was given any row: the tokens were never dispatched to their experts. See hint 3."),
    Mistake("every expert runs on every row",
            lambda r: all(r.given[e] == _on_rank(r.right, r.per_rank, e // r.per_rank) for e in r.right),
            lambda r: "each expert was given every row that came to its rank, its own and its neighbours': an "
                      "expert runs on its own rows only (a real layer would pay the expert compute "
                      f"{r.per_rank} times over). See hint 2."),
    Mistake("expert index not sent", lambda r: r.same_rows and not r.wrong_ranks,
            "the rows reach the right rank but the wrong expert on it: rows from every rank arrive mixed, for "
            "any of its experts, and a row alone does not say which. See hint 1."),
    Mistake("sent to the wrong rank", lambda r: r.same_rows,
            lambda r: f"rows reach the wrong rank: rank {r.wrong_ranks[0]}'s experts were given rows routed to "
                      f"experts of other ranks. Expert e lives on rank e // {r.per_rank}, as its "
                      f"experts[e % {r.per_rank}]. See hint 1."),
    Mistake("global id compared with local index", lambda r: bool(r.starved),
            lambda r: f"experts {r.starved} were given none of the rows routed to them, while the others got "
                      "exactly theirs: a global expert id was compared with an index into `experts`. On rank 0 the "
                      "two are the same number, on the other ranks they are not. See hint 1."),
    Mistake("capacity not applied", lambda r: r.given_by("no capacity") or bool(r.over_capacity),
            lambda r: "the capacity is not applied: expert {0} was given more than {2} of rank {1}'s tokens. Each "
                      "expert accepts at most `capacity` of a rank's assignments; the rest are dropped before the "
                      "dispatch. See hint 1.".format(*(r.over_capacity or [(0, 0)])[0], r.capacity)),
    Mistake("dropped in token order", lambda r: r.given_by("token order"),
            "the wrong assignments are dropped: the experts kept them in token order (both choices of token 0, "
            "then token 1, ...). First choices come before every second choice. See hint 1."),
    Mistake("second choice ignored", lambda r: r.given_by("first choices only"),
            "the second choices are ignored: every token goes to its top 2 experts. See hint 1."),
    Mistake("tokens out of step with their experts", lambda r: r.given_by("tokens out of step"),
            "each expert was given as many rows as it accepted, but the wrong tokens: the token ids are laid out "
            "token by token (0, 0, 1, 1, ...), the experts choice by choice, so the i-th row sent is not the "
            "i-th assignment's token. See hint 2."),
)


def _check_routing(reports, world) -> None:
    """Each expert was given exactly its own rows."""
    r = _Routing(reports, world)
    if r.given == r.right:
        return
    before = f"moe_forward on {world} ranks: "
    name_the_first(ROUTING_MISTAKES, r, before=before)
    e = next(e for e in r.right if r.given.get(e) != r.right[e])
    raise CheckFailed(before + f"rows reach the wrong expert (expert {e} got {len(r.given.get(e, []))} rows, "
                      f"{len(set(r.given.get(e, [])) & set(r.right[e]))} of them its own, of the "
                      f"{len(r.right[e])} routed to it): each accepted assignment sends its token's row to its "
                      "expert. See hint 1.")


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
        _check_routing(reports, world)
        want = reference(reports, world)
        tokens, dim = reports[0]["x"].shape
        n = world * tokens + dim + reports[0]["experts"][0]["0.weight"].shape[0]
        for rank in range(world):
            _check_output(reports[rank]["y"], want, rank, n, before=f"moe_forward on {world} ranks: ")
        _check_gradients(reports, world, want, n)
    passed(f"moe_forward dispatches, drops and combines as one process does on "
           f"{', '.join(map(str, sorted(jobs)))} ranks, forward and backward")


# What an output that one process's layer does not give matches instead, and the mistake that
# makes it (readings: the rank's output y, the reference's values, the rank, the sum's length n).
OUTPUT_MISTAKES = (
    Mistake("gate not applied", lambda y, want, rank, n: _close(y, want["ungated"][rank], n),
            "the router's weights are not applied on the combine: the output is the sum of the experts' "
            "results without their gates. See hint 1."),
    Mistake("dropped tokens counted twice", lambda y, want, rank, n: _close(y, want["dropped"][rank], n),
            "dropped tokens are counted twice: a dropped assignment adds nothing here, because the residual "
            "connection around the layer already carries its token. See hint 1."),
    Mistake("dropped tokens passed through with their gates",
            lambda y, want, rank, n: _close(y, want["gated_dropped"][rank], n),
            "dropped tokens are counted twice: a dropped assignment adds nothing here, not even its gate times "
            "the token, because the residual connection around the layer already carries it. See hint 1."),
    Mistake("one of two results kept",
            lambda y, want, rank, n: bool(_both_accepted(want, rank).any())
            and _close(y[~_both_accepted(want, rank)], want["y"][rank].detach()[~_both_accepted(want, rank)], n),
            lambda y, want, rank, n: f"the {int(_both_accepted(want, rank).sum())} tokens of rank {rank} with both "
                                     "assignments accepted are wrong, the others right: one of a token's two "
                                     "results took the place of the other instead of adding to it. See hint 2."),
    # every expert got exactly its rows (the routing is checked first), so what is left is the combine
    Mistake("results not returned to positions", lambda y, want, rank, n: True,
            lambda y, want, rank, n: f"every expert was given exactly its rows, yet rank {rank}'s output differs "
                                     f"from one process's by up to {(y - want['y'][rank].detach()).abs().max().item():.3g}: "
                                     "the results do not go back to their tokens' positions. See hint 1."),
)


def _both_accepted(want, rank):
    """The tokens of ``rank`` whose two assignments were both accepted."""
    return want["accepted"][rank] == 2


def _check_output(y, want, rank, n, before) -> None:
    """Rank ``rank``'s output y is one process's, given that every expert got exactly its rows."""
    right = want["y"][rank].detach()
    if y is None or y.shape != right.shape:
        raise CheckFailed(before + f"rank {rank} returned {None if y is None else tuple(y.shape)}, expected one "
                          f"row per token, {tuple(right.shape)}.")
    if _close(y, right, n):
        return
    name_the_first(OUTPUT_MISTAKES, y, want, rank, n, before=before)


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
