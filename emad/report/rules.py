"""The rules the report states before its verdict: how a check is taken and when its label stands (the coverage
table in force), and how C1 and C2 are decided (:mod:`emad.evaluation.decisions`)."""

from __future__ import annotations

from emad.evaluation import coverage

UNCERTAINTY_RULE = (
    "Each check compares a point with full depth on the same units, in the metric's own unit (perplexity windows; "
    "prompts for exact match and ROUGE-L; items and problems for accuracies; prompts for token agreement, whose "
    "tokens are resampled and bounded by prompt), on the *confirmation* half of each task's units: the "
    "teacher-forced screen, the placement of screened points and C2's early stop chose on the other (*selection*) "
    "half, fixed by decode.split_seed and recorded in each run file. The split keeps blocks of 4 consecutive units "
    "(neighbouring windows of one text, prompts cut next to each other) together, and every bootstrap resamples "
    "those blocks whole: n is given in units and blocks. A unit whose value moved by no more than the "
    "float noise of two runs computing the same thing (1e-3 nats for a perplexity window, exact elsewhere) is "
    "unchanged. The change's 95% interval is a paired bootstrap (BCa) over the blocks, or exact (Clopper–Pearson on "
    "the units where the two runs disagree) for 0/1 scores. When every paired unit is unchanged, the data rule out "
    "only a share of differing units above the exact bound 1 − 0.025^(1/N) over the N judged units: a 1-point "
    "tolerance needs N ≥ 368 (more at the stricter level of a claim resting on several points: 437 at 97.5%), and "
    "for perplexity no share bounds a relative change (unchanged windows are unresolved). A check is *met* when its "
    "whole interval lies within the tolerance, *violated* when it lies wholly beyond, *unresolved* otherwise; "
    "*identical by construction* only where the engine proved the output equal to full depth's (it never exits and "
    "reads the final layer, or exits only where the model's state is already final: layers whose output projections "
    "are zero, checked on the weights and by running them). A check that cannot be met at its size is "
    "*underpowered* (it says how many units it needs) and kept out of the gate unless its data show it violated; one "
    "on fewer than 8 units is *not counted*; a task the screen stopped is *ruled out by the screen* where the "
    "teacher-forced violation the screen measured stands under these rules (else it is unresolved), and the point's "
    "worst check is then that violation. A point is *met* only when every check "
    "the criteria name — perplexity and every accuracy-like task the run has — counts and is met (or it is "
    "identical by construction); where every check that counts is met but a named one cannot count, it is "
    "*untested at this size*. Where one claim rests on several candidates each is judged at 1 − 0.05/m (Bonferroni "
    "over the m candidates, the first step of Holm's procedure), so the claim holds at 95% family-wise. C2 reads a "
    "speed-up of whole generations (tokens/s with the prompt's pass included; each point's run file gives its "
    "decode-only speed-up against our full depth beside it) with an interval over distinct prompts of the "
    "confirmation half (≥ 8 per domain, one block per prompt — the points and the full-depth reference back to back "
    "in one process, after an untimed warm-up, in an order reversed from one prompt to the next so that each point "
    "runs before the reference on half its prompts — Student t on the log ratios; Bonferroni over the timed "
    "candidates). What is timed over prompts: per family and domain, the decode.speed_candidates points with the "
    "fewest FLOPs among those the screen keeps, that exit early and spend fewer FLOPs than full depth on the judged "
    "half (decode.speed_flops_below), and every strategy (EAD, speculative decoding); where a decode stage runs one "
    "domain, a family's candidates are timed cheapest first and, once one passes C2 there, the rest are not "
    "(\"C2 decided for … by …\"). A point the screen rules out is not timed at all (it decodes nothing free "
    "running); every other point not timed over prompts — never exiting, too dear, beyond decode.speed_candidates, or "
    "after C2 was decided — gets decode.speed_repeats cheap timed pairs for the figures, which C2 does not read. The "
    "literal reading counts the points with a violated check or a violation measured by the screen that stands.")

DECISION_RULE = (
    "Decisions. C1 and C2 follow from named reasons, one table each, the first matching row deciding, alike for "
    "every family (docs/paper-plan.md; metrics.json gives each family's c1_reason and c2_reason). C1's candidates "
    "have ≥ aggregate.min_flops_reduction fewer FLOPs on the judged half; C2's are the points within (or possibly "
    "within) the tolerances that do less work than full depth — fewer FLOPs on the judged half, or a strategy. A "
    "pass claims that some candidate is met: each candidate is judged at 1 − 0.05/m over the m candidates "
    "(Bonferroni, 95% family-wise). A falsification claims that every candidate is beyond a tolerance (or slow): "
    "it is wrong only where some candidate is not, and that candidate's own check guards it, so the candidates are "
    "read at 95% (an intersection–union test).")


def coverage_rule() -> str:
    """What the labels rest on: the coverage table in force (:mod:`emad.evaluation.coverage`), or that there is
    none."""
    table = coverage.active()
    if table is None:
        return ("No coverage table was in force: every interval was taken at face value, whatever its size "
                "(`aggregate --coverage`).")
    return (f"A met or violated label stands only where the side of the interval it rests on (the upper bound for "
            f"met, the lower for violated; the lower for a C2 pass) covers in the coverage simulation "
            f"({table.source or 'the table in force'}: benchmarks/bench_coverage.py, from the samples of "
            f"reports/bench/coverage_samples.json, sha256 {(table.samples_sha256 or 'unrecorded')[:12]}): the true "
            f"change placed at the tolerance (and at half and twice it), a share q of 0.5% to 100% of the units "
            f"changed, whole blocks resampled, each side's coverage read at its Monte Carlo lower bound, at the "
            f"check's size and number of changed units. A side must miss at most {coverage.SLACK:g} times its "
            f"nominal rate ({table.threshold:.0%} at 95%); where it does not at the level the check is judged at, the "
            f"check is judged at the smallest simulated level where it does (its text names both levels), and only "
            f"where no simulated level does is the label withheld: the check is *underpowered*, kept out of the "
            f"gate, and says from which size its interval would cover.")
