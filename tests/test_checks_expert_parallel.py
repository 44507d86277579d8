"""Chapter 12, exercise 2: check_moe_layer passes the solution's moe_forward on 2 and 4 ranks
and names each classic mistake.

Every mistake is planted in a copy of the solution's moe_exchange.py (lines of its solution
region changed), written next to the exercise's own moe_check.py and run on 2 ranks: one
launch per mistake, 2-4 seconds each."""

import re
from pathlib import Path

import pytest

import spike_course
from spike_course.course import conventions, workers
from spike_course.checks import CheckFailed, check_moe_layer, ch12_expert_parallel as expert_parallel
from named import names
from spike_course.course.conventions import written_file
from planting import planted

import course_files

ROOT = Path(__file__).resolve().parents[1]
STEM = "12_context_and_expert_parallel"
NOTEBOOK = course_files.notebook(ROOT / "solutions" / f"{STEM}.ipynb")
HARNESS = workers.worker_cells(NOTEBOOK)[f"{STEM}/moe_check.py"]
LAYER = written_file(NOTEBOOK, f"workers/{STEM}/moe_exchange.py")


PRIORITY = "expert, weight = choice.t().reshape(-1), gate.t().reshape(-1)"
TOKENS = "token = torch.arange(len(x), device=x.device).repeat(choice.shape[1])"
ROWS = "rows, back = send_to_ranks(x[token], expert // per_rank, group)"
LABELS = "local, _ = send_to_ranks(expert % per_rank, expert // per_rank, group)"
EXPERTS = ("done = torch.zeros_like(rows)\n"
           "    for j, run in enumerate(experts):\n"
           "        done[local == j] = run(rows[local == j])  # each expert sees its own rows, and only those")
RETURN = "return torch.zeros_like(x).index_add(0, token, back(done) * weight.unsqueeze(-1))"
MISTAKES = {
    "blank": ((), r"moe_forward is not written yet"),
    "nothing_dispatched": ([("per_rank = len(experts)", "return torch.zeros_like(x)  # a trivial answer")],
                           r"no expert was given any row"),
    # which assignments survive
    "capacity_not_applied": ([("kept = (hits.cumsum(0) * hits).sum(1) <= capacity",
                               "kept = torch.ones_like(expert, dtype=torch.bool)")],
                             r"the capacity is not applied: expert 0 was given more than"),
    "dropped_in_token_order": ([(PRIORITY, "expert, weight = choice.reshape(-1), gate.reshape(-1)"),
                                (TOKENS, "token = torch.arange(len(x), device=x.device)"
                                         ".repeat_interleave(choice.shape[1])")],
                               r"the wrong assignments are dropped: the experts kept them in token order"),
    "second_choice_ignored": ([(PRIORITY, "expert, weight = choice[:, 0], gate[:, 0]"),
                               (TOKENS, "token = torch.arange(len(x), device=x.device)")],
                              r"the second choices are ignored"),
    "tokens_out_of_step_with_their_experts": ([(TOKENS, "token = torch.arange(len(x), device=x.device)"
                                                        ".repeat_interleave(choice.shape[1])")],
                                              r"as many rows as it accepted, but the wrong tokens"),
    # where the rows go
    "sent_to_the_wrong_rank": ([(ROWS, ROWS.replace("expert // per_rank", "expert % dist.get_world_size(group)")),
                                (LABELS, LABELS.replace("expert // per_rank", "expert % dist.get_world_size(group)"))],
                               r"rows reach the wrong rank: rank \d's experts were given rows routed to"),
    "expert_index_not_sent": ([(LABELS, "# (no label: the rows are taken to arrive expert by expert)"),
                               (EXPERTS, "done = torch.cat([run(part) for run, part in "
                                         "zip(experts, rows.tensor_split(len(experts)))])")],
                              r"the right rank but the wrong expert on it"),
    "global_id_compared_with_local_index": ([(LABELS, LABELS.replace("expert % per_rank", "expert"))],
                                            r"experts \[2, 3\] were given none.*a global expert id was compared"),
    "every_expert_runs_on_every_row": ([(EXPERTS.rsplit("\n", 1)[1], "        done = done + "
                                         "torch.where((local == j).unsqueeze(-1), run(rows), 0)")],
                                       r"each expert was given every row that came to its rank"),
    # the combine
    "gate_not_applied": ([(RETURN, "return torch.zeros_like(x).index_add(0, token, back(done))")],
                         r"the router's weights are not applied on the combine"),
    "one_of_two_results_kept": ([(RETURN, "y = torch.zeros_like(x)\n"
                                          "    y[token] = back(done) * weight.unsqueeze(-1)\n"
                                          "    return y")],
                                r"both assignments accepted are wrong, the others right: one of a token's two"),
    "results_not_returned_to_positions": ([(ROWS, "order = torch.argsort(expert, stable=True)  # as the lecture\n    "
                                                  + ROWS.replace("x[token]", "x[token[order]]")
                                                        .replace("expert //", "expert[order] //")),
                                           (LABELS, LABELS.replace("expert ", "expert[order] "))],
                                          r"the results do not go back to\s+their tokens' positions"),
    "dropped_tokens_counted_twice": ([(RETURN, "y = " + RETURN[len("return "):] + "\n"
                                       "    lost = torch.arange(len(x), device=x.device).repeat(choice.shape[1])[~kept]\n"
                                       "    return y.index_add(0, lost, x[lost])  # the dropped ones pass through")],
                                     r"dropped tokens are counted twice: .*already carries its token\."),
    "dropped_tokens_passed_through_with_their_gates": (
        [(RETURN, "y = " + RETURN[len("return "):] + "\n"
                  "    lost = torch.arange(len(x), device=x.device).repeat(choice.shape[1])[~kept]\n"
                  "    return y.index_add(0, lost, x[lost] * gate.t().reshape(-1)[~kept].unsqueeze(-1))")],
        r"dropped tokens are counted twice: .*not even its gate times the token"),
    "gates_cut_from_the_graph": ([(RETURN, "y, results = torch.zeros_like(x), back(done)\n"
                                           "    for i, t in enumerate(token.tolist()):\n"
                                           "        y[t] = y[t] + results[i] * weight[i].item()\n"
                                           "    return y")],
                                 r"the gates got no gradient on rank 0: the graph is cut"),
}

def run(worker, layer_source, worlds=(2,)):
    """Launch the exercise's harness on each world size next to ``layer_source``."""
    worker(layer_source, "moe_exchange.py")
    harness = worker(HARNESS, "moe_check.py")
    return {world: spike_course.launch(harness, nproc=world, echo=False, progress=False, timeout=120,
                                       check=False) for world in worlds}


@pytest.mark.processes
def test_the_solution_passes_on_2_and_4_ranks(worker, no_orphans, capsys):
    jobs = run(worker, LAYER, worlds=(2, 4))
    assert all(job.ok for job in jobs.values())
    check_moe_layer(jobs)
    assert "as one process does on 2, 4 ranks, forward and backward" in capsys.readouterr().out


# The plants of the check's tables (tests/named.py): the key with spaces for underscores; the
# blank and the gates cut from the graph are named by the check's own words.
PLANTED_MISTAKE = {key: key.replace("_", " ") for key in MISTAKES if key not in ("blank", "gates_cut_from_the_graph")}
CHECK_MODULE, PLANTS = expert_parallel, {name: key for key, name in PLANTED_MISTAKE.items()}


@pytest.mark.processes
@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_a_planted_mistake_is_named(mistake, worker, no_orphans):
    changes, message = MISTAKES[mistake]
    source = planted(LAYER, *changes) if changes else conventions.blank_source(LAYER)
    jobs = run(worker, source)
    with names(PLANTED_MISTAKE.get(mistake), says=re.compile(message, re.S)):
        check_moe_layer(jobs)
