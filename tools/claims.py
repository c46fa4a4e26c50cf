"""The FLITE and FMP papers' claims against the committed CSVs: one table per paper (and one of our own questions),
every verdict by one rule.

Each row is one claim in the paper's words (short), the paper's number, ours as mean +/- standard error over seeds
with the number of seeds and the setting that stands in for the paper's, and a verdict. Every number of ours is
computed here, at full precision, from the CSVs in docs/results/, so a row cannot drift from its data:

    python tools/claims.py --markdown docs/results/claims.md

The rule, the same for every row. A claim is turned into a **margin**: how far the data lie on the claim's side
of its condition, positive when they favour the claim, with the standard error (SE) of that margin. Then

- **holds** when the margin is at least +2 SE (it favours the claim by 2 SE or more);
- **fails** when the margin is at most -2 SE (it goes against the claim by 2 SE or more);
- **tie** otherwise: the seeds cannot tell the claim from its opposite;
- **not enough seeds** when an arm has one seed: its SE is unknown, so there is no verdict.

A quantity that is exact (bytes, counted from the encoded payloads) has SE 0: it holds when it meets the claim's
condition (margin >= 0) and fails when it does not. The margins, by the kind of claim:

- "A beats B" (higher accuracy, lower ECE or perplexity, "reverses", "improves"): the difference of the two
  means, the right way round.
- "A matches B" (within, essentially unchanged, neutral, the gap vanishes): the tolerance less |A - B|; "flat"
  over several settings: the tolerance less the largest mean minus the smallest. The tolerance is the paper's own
  where it states one (FLITE's r "moves test accuracy by < 0.2 pp"); otherwise FLITE's parity, **0.5 pp** of
  accuracy (its Table 1 calls the 0.49 pp between its 74.67% and FedAvg's 75.16% "within seed noise"), and for
  perplexity, where the paper gives none, **1%** of the reference (our choice).
- "close to centralised MP" (FMP's Table I): the largest gap the FMP paper calls close, 1.66 pp (its CIFAR-10
  column, ``fmp_claims.CLOSE_TO_MP_PP``), less MP's accuracy minus FMP's.
- "collapses to chance": at most **2.5 times chance**, the level of the FLITE paper's own collapse (2.5% with 100
  classes, chance 1%), less the accuracy.
- "1-2 orders of magnitude cheaper": log10 of the byte ratio less 1 (one order is 10x).
- "degrades at K = 4 before recovering": every other K's accuracy less K = 4's.
- "diverges" (appendix B): the final perplexity less the base's; "the largest advantage at alpha = 0.1" (FMP's
  Fig. 2): FMP's lead at alpha 0.1 less its lead at each other alpha; "gains become marginal beyond s = 30"
  (Fig. 3b): the accuracy gained from s = 10 to 30 less that gained from 30 to 50; Proposition 1: the bound less
  the measured distance at every s, and "the impact of the compression rate": the bound at the smallest s less
  the bound at the largest.
- Claims of several parts ("at every alpha", "than random selection and mean pooling", "across d, r and warm
  starts", "tolerates int8 but collapses at int4"): every part must hold; the verdict is the worst part's (fails
  before not enough seeds before tie before holds; among equals the one fewest SE on the claim's side), and the
  cell names that part.

Standard errors: a mean over n seeds has SE = std / sqrt(n) (sample std). A margin between two arms is paired
where the arms ran the same seeds of one sweep (same sweep, machine and seed: each seed's arms start from the same
pretrained base and clients, and FMP's methods are tested on the same seed's target tasks): the difference is taken
seed by seed and its SE is the std of the per-seed differences / sqrt(n), the rule the privacy and LoRA pages apply
with ``tools/paired_seeds.py``; a run against its own round 0 is paired the same way. Arms whose seeds do not pair
fall back to sqrt(SE_a^2 + SE_b^2), and the tables' notes name such rows. A mean over one seed has no SE (NaN): a
row with an arm of one seed gets "not enough seeds", not a verdict. FLITE's accuracies are each run's best test
accuracy over rounds 1 to R (the paper's metric, its Tables 1-5; for the fixed budget, over the rounds within it),
perplexities the final round's (appendix B's "best" the lowest over rounds 1 to R); FMP's are each seed's final test.

Rows the data here cannot test (the FLITE paper's TinyImageNet) say "not run here" and carry the paper's number
alone. FMP's MNIST, CIFAR-10 and CIFAR-100 are not available offline either; its rows test the claims on digits
and Fashion-MNIST features, the analogues on docs/results-fmp.md. Questions of ours that neither paper asks
(FLITE's latent on a pretrained LLM) are a third table, "our own questions", by the same rule.
"""

import argparse
import csv
import math
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

TIE = 2.0  # standard errors: a margin inside +/- TIE SE is a tie
PARITY = 0.005  # FLITE's "matches": 0.5 pp of accuracy
PARITY_PPL = 0.01  # "matches" for perplexity: 1% of the reference (our choice; the paper gives none)
COLLAPSE = 2.5  # "collapses to chance": at most 2.5x chance (FLITE: 2.5% with 100 classes)
CLASSES = 10  # Fashion-MNIST's classes: chance 0.1
RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results"
UNDECIDED = "not enough seeds"  # the verdict of a margin with an arm of one seed
WORDS = ("fails", UNDECIDED, "tie", "holds")  # worst first: a part that fails decides, then one without seeds


def sibling(name: str):
    """Another script of tools/ as a module (they are scripts, not a package)."""
    folder = str(Path(__file__).resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return __import__(name)


# --- the rule ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mean:
    """A mean over ``n`` seeds and its standard error (0 for an exact quantity; NaN for a single seed, which has no
    spread to measure). ``values`` holds each seed's value, keyed by (sweep, environment, seed), where a mean is over
    runs of a sweep: two means over the same runs' seeds subtract seed by seed (:meth:`__sub__`)."""

    mean: float
    se: float
    n: int
    values: tuple = field(default=(), compare=False)  # ((key, value), ...), per seed
    unpaired: bool = field(default=False, compare=False)  # a difference of two means whose seeds do not pair

    def __sub__(self, other: "Mean") -> "Mean":
        """The difference of two means. Where both hold the same seeds (the same sweep, machine and seed: each seed's
        arms start from the same base and data), it is the mean of the per-seed differences with their own SE
        (paired); against an exact quantity (SE 0, no seeds) it is each seed's value less it; otherwise the
        difference of the means with SE sqrt(SE_a^2 + SE_b^2) (unpaired)."""
        mine, theirs = dict(self.values), dict(other.values)
        if mine and mine.keys() == theirs.keys():
            keys = sorted(mine)
            return mean_se([mine[k] - theirs[k] for k in keys], keys)
        if mine and other.n == 0 and other.se == 0:
            return mean_se([v - other.mean for v in mine.values()], list(mine))
        if theirs and self.n == 0 and self.se == 0:
            return mean_se([self.mean - v for v in theirs.values()], list(theirs))
        return Mean(self.mean - other.mean, math.hypot(self.se, other.se), min(self.n, other.n), unpaired=True)


def mean_se(values: list[float], keys: list | None = None) -> Mean:
    """Mean and standard error over seeds (std / sqrt(n), sample std); one value: SE NaN (one seed has no spread, so
    no verdict rests on it). ``keys`` name the seeds (``run_key``), for paired differences."""
    values = [float(v) for v in values]
    keyed = tuple(zip(keys, values, strict=True)) if keys is not None else ()
    if not values:
        return Mean(math.nan, math.nan, 0)
    if len(values) < 2:
        return Mean(values[0], math.nan, 1, keyed)
    return Mean(statistics.fmean(values), statistics.stdev(values) / math.sqrt(len(values)), len(values), keyed)


def run_key(r: dict) -> tuple[str, str, str]:
    """What names one seed's run across the labels of a sweep CSV: its sweep, the machine it ran on (the
    ``environment`` column, where the CSV has one) and its seed. Runs with equal keys share the seed's base."""
    return str(r.get("sweep", "")), str(r.get("environment", "")), str(r["seed"])


def verdict(margin: float, se: float, tie: float = TIE) -> str:
    """holds / tie / fails: the margin (positive favours the claim) against ``tie`` standard errors of it; an exact
    margin (``se`` 0) holds when it is at least 0 and fails below; a margin whose SE is NaN (an arm with one seed)
    has no verdict: "not enough seeds"."""
    if math.isnan(se):
        return UNDECIDED
    if se == 0:
        return "holds" if margin >= 0 else "fails"
    if margin >= tie * se:
        return "holds"
    if margin <= -tie * se:
        return "fails"
    return "tie"


@dataclass(frozen=True)
class Test:
    """One condition of a claim: its margin (positive favours the claim), the margin's SE, and where it applies;
    ``unpaired`` when the SE is that of a difference of two means whose seeds do not pair."""

    margin: float
    se: float
    where: str = ""
    unpaired: bool = field(default=False, compare=False)

    @property
    def k(self) -> float:
        """The margin in standard errors (+/- inf when exact, NaN without an SE)."""
        if math.isnan(self.se):
            return math.nan
        if self.se > 0:
            return self.margin / self.se
        return math.inf if self.margin >= 0 else -math.inf

    def verdict(self, tie: float = TIE) -> str:
        return verdict(self.margin, self.se, tie)


def every(tests: list[Test], tie: float = TIE) -> Test:
    """A claim made of several conditions holds only if each does: the worst condition decides."""
    return min(tests, key=lambda t: (WORDS.index(t.verdict(tie)), 0.0 if math.isnan(t.k) else t.k))


def beats(a: Mean, b: Mean, where: str = "", lower: bool = False) -> Test:
    """ "A beats B": A - B (B - A where lower is better)."""
    d = b - a if lower else a - b
    return Test(d.mean, d.se, where, d.unpaired)


def within(a: Mean, b: Mean, tolerance: float, where: str = "") -> Test:
    """ "A matches B": ``tolerance`` less |A - B|."""
    d = a - b
    return Test(tolerance - abs(d.mean), d.se, where, d.unpaired)


def flat(means: dict[str, Mean], tolerance: float) -> Test:
    """ "flat over settings": ``tolerance`` less the largest minus the smallest mean."""
    hi, lo = max(means, key=lambda k: means[k].mean), min(means, key=lambda k: means[k].mean)
    d = means[hi] - means[lo]
    return Test(tolerance - d.mean, d.se, f"{hi} against {lo}", d.unpaired)


# --- reading the CSVs --------------------------------------------------------------------------------------------


def read(name: str) -> list[dict]:
    with (RESULTS / name).open(newline="") as f:
        return list(csv.DictReader(f))


def per_seed(rows: list[dict], label: str) -> dict[tuple, list[dict]]:
    """A label's rows per seed (keyed by :func:`run_key`), in round order."""
    runs: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        if r["label"] == label:
            runs[run_key(r)].append(r)
    if not runs:
        raise SystemExit(f"no rows labelled {label!r}")
    for rs in runs.values():
        rs.sort(key=lambda r: int(r["round"]))
    return runs


def value(r: dict, column: str) -> float | None:
    v = r.get(column)
    return float(v) if v not in ("", None) else None


def best(rows: list[dict], label: str, column: str = "val/acc", lower: bool = False) -> Mean:
    """Each seed's best ``column`` over rounds 1 to R, as mean +/- SE over seeds."""
    pick = min if lower else max
    runs = per_seed(rows, label)
    return mean_se(
        [pick(v for r in rs if int(r["round"]) >= 1 and (v := value(r, column)) is not None) for rs in runs.values()],
        list(runs),
    )


def final(rows: list[dict], label: str, column: str) -> Mean:
    """Each seed's last logged ``column``, as mean +/- SE over seeds."""
    runs = per_seed(rows, label)
    return mean_se([[v for r in rs if (v := value(r, column)) is not None][-1] for rs in runs.values()], list(runs))


def change(rows: list[dict], label: str, column: str, at=None) -> Mean:
    """Each seed's ``column`` at the final round (or ``at(values)`` over rounds 1 to R) less its round 0."""
    out = []
    runs = per_seed(rows, label)
    for rs in runs.values():
        start = value(rs[0], column)
        later = [v for r in rs if int(r["round"]) >= 1 and (v := value(r, column)) is not None]
        out.append((at(later) if at else later[-1]) - start)
    return mean_se(out, list(runs))


def upload(rows: list[dict], label: str) -> float:
    """Bytes of one upload (the same every round)."""
    return max(v for r in rows if r["label"] == label and (v := value(r, "comm/client_up_bytes")) is not None)


# --- formatting --------------------------------------------------------------------------------------------------


def acc(m: Mean) -> str:
    return f"{m.mean:.4f}" if m.n < 2 else f"{m.mean:.4f} +/- {m.se:.4f}"


def pp(m: Mean) -> str:
    return f"{100 * m.mean:+.2f} +/- {100 * m.se:.2f} pp"


def seeds(*means: Mean) -> str:
    counts = sorted({m.n for m in means})
    return " / ".join(map(str, counts)) + (" seed" if counts == [1] else " seeds")


def verdict_cell(test: Test | None, tie: float = TIE) -> str:
    if test is None:
        return "not run here (TinyImageNet not available offline)"
    where = f", {test.where}" if test.where else ""
    if math.isnan(test.k):
        return f"**{UNDECIDED}** (an arm has one seed{where})"
    k = "exact" if math.isinf(test.k) else f"{test.k:+.1f} SE"
    return f"**{test.verdict(tie)}** ({k}{where})"


@dataclass
class Row:
    source: str
    claim: str
    paper: str
    ours: str
    test: Test | None
    short: str  # a few words for the one-line summary
    tag: str = ""  # the data set, where a claim has a row per data set
    missing: str = "not run here (TinyImageNet not available offline)"  # the verdict cell of a row without data


# --- FLITE -------------------------------------------------------------------------------------------------------

FASHION = "Fashion-MNIST, SmallCNN, 10,800 client images, K = 8"
SHRUNK = FASHION + ", R = 8"


def flite_rows() -> list[Row]:
    f, rerun = read("flite_fashion_mnist.csv"), read("flite_fashion_mnist_rerun.csv")
    head = read("flite_headroom_fashion_mnist.csv")
    rows = []

    def pair(csv_rows, a, b, name_a, name_b):
        ma, mb = best(csv_rows, a), best(csv_rows, b)
        return ma, mb, f"{name_a} {acc(ma)}, {name_b} {acc(mb)}: {pp(ma - mb)}"

    lat, fed, text = pair(f, "latent", "fedavg", "latent", "matched FedAvg")
    ratio = upload(f, "fedavg") / upload(f, "latent")
    rows.append(
        Row(
            "abstract, §5.1",
            'the latent "reaches 74.67%, within ~0.5 pp of full-weight FedAvg (75.16%)" at 8,718x '
            "fewer parameters per round",
            "CIFAR-100: 74.67% vs 75.16% (-0.49 pp)",
            f"{text}; {upload(f, 'latent'):,.0f} vs {upload(f, 'fedavg'):,.0f} B per upload ({ratio:,.0f}x) "
            f"({seeds(lat, fed)}; {SHRUNK}, base pretrained on 1,200 public images)",
            within(lat, fed, PARITY),
            "within 0.5 pp of FedAvg (public base)",
        )
    )
    lat, fed, text = pair(f, "latent_clientbase", "fedavg_clientbase", "latent", "matched FedAvg")
    rows.append(
        Row(
            "§5.1",
            "the same, with the base pretrained on the clients' own distribution, as the paper's are",
            "as above",
            f"{text} ({seeds(lat, fed)}; as above, base pretrained on the clients' images)",
            within(lat, fed, PARITY),
            "within 0.5 pp of FedAvg (base from the clients' data)",
        )
    )
    lat, fed, text = pair(head, "latent_d64_full_base600", "fedavg_full_base600", "latent", "matched FedAvg")
    rows.append(
        Row(
            "§5.1",
            "the same at full scale",
            "as above",
            f"{text} ({seeds(lat, fed)}; Fashion-MNIST, 54,000 client images, K = 8, R = 20, d = r = 64, base "
            "pretrained on 600 public images)",
            within(lat, fed, PARITY),
            "within 0.5 pp of FedAvg (full scale)",
        )
    )
    lat, fed, text = pair(rerun, "latent", "fedavg_textbook", "latent", "textbook FedAvg")
    rows.append(
        Row(
            "§5.2",
            'under IID the latent is "within seed noise of FedAvg" (textbook: trainable Kaiming head)',
            "-0.25 pp (CIFAR-10), -0.23 pp (CIFAR-100)",
            f"{text} ({seeds(lat, fed)}; {SHRUNK}, rerun set)",
            within(lat, fed, PARITY),
            "parity with textbook FedAvg, IID",
        )
    )
    lat, fed, text = pair(rerun, "latent_dir0.1", "fedavg_textbook_dir0.1", "latent", "textbook FedAvg")
    rows.append(
        Row(
            "§5.2",
            'under alpha = 0.1 "the comparison reverses": the latent ahead of textbook FedAvg',
            "+0.39 pp (CIFAR-10), +0.97 pp (CIFAR-100)",
            f"{text} ({seeds(lat, fed)}; {SHRUNK}, Dirichlet 0.1, rerun set)",
            beats(lat, fed),
            "ahead of textbook FedAvg at alpha 0.1",
        )
    )
    rows.append(pareto_row(f))
    means = {
        f"d = {d:,}": best(rerun, label)
        for label, d in (
            ("latent", 64),
            ("latent_d128", 128),
            ("latent_d256", 256),
            ("latent_d512", 512),
            ("latent_d1024", 1024),
        )
    }
    rows.append(
        Row(
            "§5.3, Table 3",
            'from d = 64 to d = 1,024 "accuracy is essentially flat"',
            "74.67% (d = 64), 74.66% (1,024)",
            "; ".join(f"{k} {acc(m)}" for k, m in means.items()) + f" ({seeds(*means.values())}; {SHRUNK}, r = 32, "
            "rerun set)",
            flat(means, PARITY),
            "accuracy flat in d",
        )
    )
    lat, fed, text = pair(f, "latent_dir0.1", "fedavg_dir0.1", "latent", "matched FedAvg")
    rows.append(
        Row(
            "abstract, §5.4",
            '"matches or exceeds full-weight FedAvg under strong non-IID skew": at alpha = 0.1 the latent ahead',
            "CIFAR-10: 94.07% vs 93.79% (+0.28 pp)",
            f"{text} ({seeds(lat, fed)}; {SHRUNK}, Dirichlet 0.1)",
            beats(lat, fed),
            "ahead of full-weight FedAvg at alpha 0.1",
        )
    )
    lat, fed, text = pair(f, "latent_dir0.5", "fedavg_dir0.5", "latent", "matched FedAvg")
    rows.append(
        Row(
            "§5.4",
            'the gap to full-weight FedAvg "vanishes at alpha = 0.5"',
            "CIFAR-10 (figure only)",
            f"{text} ({seeds(lat, fed)}; {SHRUNK}, Dirichlet 0.5)",
            within(lat, fed, PARITY),
            "parity with FedAvg at alpha 0.5",
        )
    )
    rows += [budget_row(rerun), paper_budget_row()]
    means = {
        f"K = {k}": best(rerun, label)
        for label, k in (
            ("latent_dir0.5_K4", 4),
            ("latent_dir0.5", 8),
            ("latent_dir0.5_K16", 16),
            ("latent_dir0.5_K32", 32),
        )
    }
    rows.append(
        Row(
            "§5.5, App. A.2",
            '"our latent accuracy is essentially flat in K" (alpha = 0.5)',
            "CIFAR-100 (figure only)",
            "; ".join(f"{k} {acc(m)}" for k, m in means.items()) + f" ({seeds(*means.values())}; Fashion-MNIST, "
            "SmallCNN, the same 10,800 images over K clients, R = 8, Dirichlet 0.5, rerun set)",
            flat(means, PARITY),
            "latent flat in K",
        )
    )
    fed = {
        k: best(rerun, label)
        for label, k in (
            ("fedavg_dir0.5_K4", 4),
            ("fedavg_dir0.5", 8),
            ("fedavg_dir0.5_K16", 16),
            ("fedavg_dir0.5_K32", 32),
        )
    }
    rows.append(
        Row(
            "§5.5, App. A.2",
            'full-weight FedAvg under alpha = 0.5 "degrades to 74.2% at K = 4 before recovering at '
            'large K": lowest at K = 4',
            "74.2% at K = 4 (CIFAR-100)",
            "; ".join(f"K = {k} {acc(m)}" for k, m in fed.items()) + f" ({seeds(*fed.values())}; as above)",
            every([beats(fed[k], fed[4], f"K = {k}") for k in (8, 16, 32)]),
            "FedAvg dips at K = 4 and recovers",
        )
    )
    orth, train, kaim = best(f, "latent"), best(f, "latent_head_trainable"), best(f, "latent_head_kaiming")
    rows.append(
        Row(
            "§5.6",
            'freezing an orthogonal head "improves accuracy" over a trainable one',
            "73.53% vs 72.99% (+0.54 pp)",
            f"orthogonal {acc(orth)}, trainable {acc(train)}: {pp(orth - train)} ({seeds(orth, train)}; {SHRUNK})",
            beats(orth, train),
            "orthogonal head beats a trainable one",
        )
    )
    rows.append(
        Row(
            "§5.6",
            'freezing a Kaiming-initialised head "is accuracy-neutral" against a trainable one',
            "72.95% vs 72.99%",
            f"frozen Kaiming {acc(kaim)}, trainable {acc(train)}: {pp(kaim - train)} ({seeds(kaim, train)}; {SHRUNK})",
            within(kaim, train, PARITY),
            "frozen Kaiming head neutral",
        )
    )
    means = {
        f"r = {r}": best(f, label)
        for label, r in (
            ("latent_d256_r8", 8),
            ("latent_d256", 32),
            ("latent_d256_r128", 128),
            ("latent_d256_r256", 256),
        )
    }
    rows.append(
        Row(
            "§5.6, App. F",
            'r in {8, 32, 128, 256} at d = 256 "moves test accuracy by < 0.2 pp"',
            "< 0.2 pp",
            "; ".join(f"{k} {acc(m)}" for k, m in means.items()) + f" ({seeds(*means.values())}; {SHRUNK}, d = 256)",
            flat(means, 0.002),
            "r moves accuracy < 0.2 pp",
        )
    )
    rows.append(scratch_row(rerun))
    rows.append(
        Row(
            "§5.8",
            'TinyImageNet, IID: the latent "matches full-weight FedAvg within 0.2 pp"',
            "62.14% vs 62.34% (ResNet-34, d = 1,024)",
            "-",
            None,
            "TinyImageNet, IID",
        )
    )
    rows.append(
        Row(
            "§5.8",
            'TinyImageNet, alpha = 0.5: the latent "is more accurate"',
            "62.22% vs 60.79% (+1.43 pp)",
            "-",
            None,
            "TinyImageNet, alpha 0.5",
        )
    )
    fp32, i8, i4 = best(f, "latent"), best(f, "latent_int8"), best(f, "latent_int4")
    rows.append(
        Row(
            "abstract, §5.9",
            'quantising the latent to int8 or int4 "leaves accuracy essentially unchanged"',
            "int4 74.73% vs fp32 74.72% (648 B)",
            f"fp32 {acc(fp32)}, int8 {acc(i8)}, int4 {acc(i4)} "
            f"({upload(f, 'latent_int4'):,.0f} B per upload at int4) ({seeds(fp32, i8, i4)}; {SHRUNK})",
            every([within(i8, fp32, PARITY, "int8"), within(i4, fp32, PARITY, "int4")]),
            "int8 / int4 latents unchanged",
        )
    )
    fp32, i8, i4 = (
        best(rerun, x) for x in ("fedavg_textbook", "fedavg_textbook_int8_update", "fedavg_textbook_int4_update")
    )
    chance = Mean(COLLAPSE / CLASSES, 0.0, 0)
    rows.append(
        Row(
            "abstract, §5.9",
            'textbook full-weight FedAvg "tolerates int8 but collapses at int4" (to chance)',
            "int4: 1.11% (chance: 1%)",
            f"update quantised as the paper does: fp32 {acc(fp32)}, int8 {acc(i8)}, int4 "
            f"{acc(i4)} (collapse: <= {chance.mean:.2f}) ({seeds(fp32, i8, i4)}; {SHRUNK}, rerun set)",
            every([within(i8, fp32, PARITY, "int8"), beats(chance, i4, "int4")]),
            "int4 full-weight FedAvg collapses",
        )
    )
    rows += appendix_b_rows()
    return rows


def pareto_row(f: list[dict]) -> Row:
    """Claim 4: bytes per client until the mean accuracy first reaches the latent's final mean (bytes_to_reach)."""
    reach = sibling("bytes_to_reach").reach
    target = final(f, "latent", "val/acc").mean
    others = {
        "powersgd_r2": "PowerSGD r2",
        "powersgd_r8": "PowerSGD r8",
        "topk_1pct": "top-k 1%",
        "topk_10pct": "top-k 10%",
    }
    got = {
        label: (k, up, held)
        for label, k, up, _total, held in reach(RESULTS / "flite_fashion_mnist.csv", ["latent", *others], target)
    }
    _, up0, held0 = got["latent"]
    tests = [Test(math.log10(got[x][2] / held0) - 1, 0.0, name) for x, name in others.items()]
    parts = [
        f"{name} {got[x][2] / held0:.1f}x (round {got[x][0]}; uploads {got[x][1] / up0:.1f}x)"
        for x, name in others.items()
    ]
    return Row(
        "§5.3, Fig. 2",
        'the latent is "a further 1-2 orders of magnitude cheaper at matched accuracy" than PowerSGD and top-k',
        "CIFAR-10 (figure only): 10x to 100x",
        f"bytes per client to reach the latent's final accuracy ({target:.4f}), every client holding the base, as "
        f"FLITE's do: latent {held0:,.0f} B (round {got['latent'][0]}); against it "
        + ", ".join(parts)
        + f" ({len(per_seed(f, 'latent'))} seeds, exact bytes; {SHRUNK}, full-weight downloads)",
        every(tests),
        "1-2 orders of magnitude fewer bytes than PowerSGD / top-k",
    )


def within_budget(rows: list[dict], label: str, budget: float) -> list[dict]:
    """``label``'s rows whose cumulative bytes per client stay within ``budget``."""
    out = []
    for r in rows:
        spent = value(r, "comm/cum_client_bytes")
        if r["label"] == label and spent is not None and spent <= budget:
            out.append(r)
    return out


def budget_row(rerun: list[dict]) -> Row:
    """Claim 9: within one full-weight round's bytes, the latent's rounds against that one round."""
    fed = best(rerun, "fedavg_dir0.5_R1_E1")
    budget = max(v for r in rerun if r["label"] == "fedavg_dir0.5_R1_E1" and (v := value(r, "comm/cum_client_bytes")))
    spent = within_budget(rerun, "latent_dir0.5_R16", budget)
    lat = best(spent, "latent_dir0.5_R16")
    rounds = max(int(r["round"]) for r in spent)
    used = max(value(r, "comm/cum_client_bytes") for r in spent)
    return Row(
        "§5.5, App. A.1",
        "at a fixed per-client budget the latent's many rounds beat full-weight FedAvg's one",
        "200 MB, CIFAR-10, alpha = 0.5: 94.21% vs 93.48% (+0.73 pp)",
        f"budget = one full-weight round ({budget:,.0f} B): latent {rounds} rounds {acc(lat)}, FedAvg 1 round of 1 "
        f"epoch {acc(fed)}: {pp(lat - fed)} ({seeds(lat, fed)}; {FASHION}, Dirichlet 0.5, rerun set; the latent "
        f"spends {used:,.0f} B, {100 * used / budget:.1f}% of the budget, the paper's latent all of it: next row)",
        beats(lat, fed),
        "ahead of one FedAvg round at a fixed budget (16 rounds)",
    )


BUDGET_CSV = "flite_budget_fashion_mnist.csv"  # tools/sweeps/flite_budget_fashion_mnist.yaml
PAPER_ROUNDS = 150  # the paper's latent rounds within its budget ("~150 latent rounds")


def paper_budget_row() -> Row:
    """Claim 9 at the paper's budget: the latent spends all of one full-weight round's bytes, against that round (the
    arms of each seed in one sweep). Not run yet while its CSV is missing."""
    claim = (
        "the same at the paper's budget: the latent spends the budget (its best within the budget; within the "
        f"paper's ~{PAPER_ROUNDS} rounds beside it)"
    )
    paper, short = "as above", "ahead of one FedAvg round, the budget spent"
    if not (RESULTS / BUDGET_CSV).is_file():
        command = "python tools/sweep.py tools/sweeps/flite_budget_fashion_mnist.yaml"
        missing = f"not run yet (`{command}`, about 18 CPU hours)"
        return Row("§5.5, App. A.1", claim, paper, "-", None, short, missing=missing)
    rows = read(BUDGET_CSV)
    fed = best(rows, "fedavg_dir0.5_R1_E1")
    budget = max(v for r in rows if r["label"] == "fedavg_dir0.5_R1_E1" and (v := value(r, "comm/cum_client_bytes")))
    spent = within_budget(rows, "latent_dir0.5_budget", budget)
    lat = best(spent, "latent_dir0.5_budget")
    early = best([r for r in spent if int(r["round"]) <= PAPER_ROUNDS], "latent_dir0.5_budget")
    rounds = max(int(r["round"]) for r in spent)
    used = max(value(r, "comm/cum_client_bytes") for r in spent)
    return Row(
        "§5.5, App. A.1",
        claim,
        paper,
        f"budget = one full-weight round ({budget:,.0f} B): latent {rounds} rounds ({used:,.0f} B) {acc(lat)}, "
        f"within {PAPER_ROUNDS} rounds {acc(early)}; FedAvg 1 round of 1 epoch {acc(fed)}: {pp(lat - fed)} "
        f"({seeds(lat, fed)}; {FASHION}, Dirichlet 0.5, budget sweep)",
        beats(lat, fed),
        short,
    )


def scratch_row(rerun: list[dict]) -> Row:
    """Claim 7: from a random base, every d, r and warm start against the collapse level (2.5x chance)."""
    variants = {
        "d = 64": "latent_scratch",
        "d = 1,024": "latent_scratch_d1024",
        "d = 4,096": "latent_scratch_d4096",
        "d = 16,384": "latent_scratch_d16384",
        "r = 8": "latent_scratch_d4096_r8",
        "r = 128": "latent_scratch_d4096_r128",
        "least-squares teacher fit": "latent_scratch_d4096_teacher",
        "1-epoch SGD warm-up": "latent_warmup1_d4096",
        "PCANet base": "latent_pcanet_d4096",
    }
    means = {name: best(rerun, label) for name, label in variants.items()}
    level = Mean(COLLAPSE / CLASSES, 0.0, 0)
    lo, hi = min(means, key=lambda k: means[k].mean), max(means, key=lambda k: means[k].mean)
    return Row(
        "§5.7, App. E",
        'from a random base the latent "collapses to ~2.5% test accuracy", across d in {1024, 4096, '
        "16384}, r in {8, ..., 256} and warm starts",
        "2.5% (100 classes, chance 1%)",
        f"{len(means)} variants: lowest {lo} {acc(means[lo])}, highest {hi} {acc(means[hi])} (collapse: <= "
        f"{level.mean:.2f}; chance {1 / CLASSES:.2f}) ({seeds(*means.values())}; {SHRUNK}, r = 32 unless stated, "
        "d = 4,096 for r and warm starts, rerun set)",
        every([beats(level, m, name) for name, m in means.items()]),
        "collapse to chance from a random base",
    )


def appendix_b_rows() -> list[Row]:
    s = read("shakespeare.csv")
    lat, lat_base = change(s, "latent", "val/ppl"), final_base(s, "latent")
    improve, diverge = change(s, "fedavg", "val/ppl", at=min), change(s, "fedavg", "val/ppl")
    fed_best = best(s, "fedavg", "val/ppl", lower=True)
    fed_final = final(s, "fedavg", "val/ppl")
    ratio = upload(s, "fedavg") / upload(s, "latent")
    setting = (
        f"Shakespeare by role, TinyGPT 4 x 128, 8 of 316 clients a round, R = 20; {upload(s, 'latent'):,.0f} "
        f"vs {upload(s, 'fedavg'):,.0f} B per upload ({ratio:.0f}x)"
    )
    return [
        Row(
            "App. B",
            'the latent holds validation perplexity "essentially at the shared pretrained base"',
            "WikiText-2: 66.09 throughout (313x fewer bytes)",
            f"base {lat_base.mean:.4f}, change after 20 rounds {lat.mean:+.4f} +/- {lat.se:.4f} "
            f"({100 * lat.mean / lat_base.mean:+.2f}%) ({seeds(lat)}; {setting})",
            Test(PARITY_PPL * lat_base.mean - abs(lat.mean), lat.se),
            "LM: the latent holds the base's perplexity",
        ),
        Row(
            "App. B",
            'full-weight FedAvg "can briefly improve perplexity in early rounds but then diverges"',
            "best 61.71, final 81.06 (base 66.09)",
            f"best {fed_best.mean:.4f} ({improve.mean:+.4f} +/- {improve.se:.4f} from the base), final "
            f"{fed_final.mean:.4f} ({diverge.mean:+.4f} +/- {diverge.se:.4f}) ({seeds(improve)}; as above)",
            every([Test(-improve.mean, improve.se, "improves"), Test(diverge.mean, diverge.se, "diverges")]),
            "LM: full-weight FedAvg improves, then diverges",
        ),
    ]


def final_base(rows: list[dict], label: str) -> Mean:
    """Round 0 (the pretrained base) of ``column`` val/ppl, mean over seeds."""
    return mean_se([value(rs[0], "val/ppl") for rs in per_seed(rows, label).values()])


# --- our own questions -------------------------------------------------------------------------------------------


def own_rows() -> list[Row]:
    """Questions of ours that neither paper asks, by the same rule: FLITE's latent on a pretrained LLM (the FLITE
    paper has no LLM)."""
    frontier = sibling("llm_frontier")
    runs = frontier.runs_of([RESULTS / "smollm2_frontier.csv"])
    finals: dict[str, tuple[list, list]] = defaultdict(lambda: ([], []))
    for (label, seed), rs in runs.items():
        finals[label][0].append(frontier.summary(rs)["final_ppl"])
        finals[label][1].append(("smollm2_frontier", "", str(seed)))
    flite, fed = mean_se(*finals["flite_d1444"]), mean_se(*finals["fedavg"])
    up = {label: frontier.summary(rs)["bytes"] for (label, _seed), rs in runs.items()}
    return [
        Row(
            "SmolLM2-135M (not in the paper, which has no LLM)",
            "FLITE's latent matches full fine-tuning (full-weight FedAvg) at a fraction of the bytes, as the paper "
            "finds on CIFAR-100 (within ~0.5 pp of FedAvg at 8,718x fewer parameters)",
            "none (no LLM in the paper)",
            f"test perplexity after 8 rounds: FLITE d = r = 1,444 {flite.mean:.2f} +/- {flite.se:.2f} "
            f"({flite.n} seeds), full-weight FedAvg {fed.mean:.2f} ({fed.n} seed{'s' * (fed.n > 1)}): "
            f"{100 * (flite.mean / fed.mean - 1):+.1f}%; {up['flite_d1444']:,.0f} vs {up['fedavg']:,.0f} B per upload "
            f"({up['fedavg'] / up['flite_d1444']:.0f}x) ({seeds(flite, fed)}; SmolLM2-135M, 64 Shakespeare roles)",
            within(flite, fed, PARITY_PPL * fed.mean, "full-weight FedAvg" if fed.n < 2 else ""),
            "SmolLM2: the latent matches full weights",
        ),
        instruction_row(),
    ]


def instruction_row() -> Row:
    """FLITE's latent against LoRA at equal bytes on the built-in instruction task: test exact match after 30
    rounds, each method at the rate chosen on validation data (tools/sweeps/smollm2_instruct.yaml)."""
    rows = read("smollm2_instruct.csv")
    flite, lora = final(rows, "flite_d1444", "test/exact_match"), final(rows, "lora_r1", "test/exact_match")
    base = mean_se([value(rs[0], "test/exact_match") for rs in per_seed(rows, "lora_r1").values()])
    return Row(
        "SmolLM2-135M-Instruct (not in the paper)",
        "FLITE's latent matches LoRA at equal upload bytes on a task scored by generation (within 0.5 pp of exact "
        "match, the paper's parity margin)",
        "none (no LLM in the paper)",
        f"test exact match after 30 rounds (200 questions): FLITE d = r = 1,444 {acc(flite)}, LoRA r = 1 {acc(lora)} "
        f"(base {base.mean:.4f}); {upload(rows, 'flite_d1444'):,.0f} vs {upload(rows, 'lora_r1'):,.0f} B per upload "
        f"({seeds(flite, lora)}; the built-in instruction task, 40 clients, rates chosen on validation data)",
        within(flite, lora, PARITY),
        "SmolLM2-Instruct: the latent matches LoRA",
    )


# --- FMP ---------------------------------------------------------------------------------------------------------


def fmp_rows() -> list[Row]:
    """FMP's rows: tools/fmp_claims.py on the Table I sweeps (the paper's read-out) and the summary-size sweeps."""
    fc = sibling("fmp_claims")
    rows = []
    for name, table_csv, size_csv in (
        ("digits", "fmp_baselines_digits_paper.csv", "fmp_summary_size_digits.csv"),
        ("Fashion-MNIST", "fmp_baselines_fashion_mnist_paper.csv", "fmp_summary_size_fashion_mnist.csv"),
    ):
        rows += fc.table_rows(fc.finals(read(table_csv)), name, fc.SETTINGS[name])
        rows += fc.size_rows(fc.finals(read(size_csv)), name)
    return rows


# --- output ------------------------------------------------------------------------------------------------------


def table(rows: list[Row], tie: float = TIE) -> str:
    lines = [
        "| # | claim (the paper's words, short) | the paper | ours: mean +/- SE (seeds; setting) | verdict |",
        "| --- | --- | --- | --- | --- |",
    ]
    for i, r in enumerate(rows, 1):
        cell = verdict_cell(r.test, tie) if r.test is not None else r.missing
        lines.append(f"| {i} | {r.source}: {r.claim} | {r.paper} | {r.ours} | {cell} |")
    return "\n".join(lines)


def counts(rows: list[Row], tie: float = TIE) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {w: [] for w in ("holds", "tie", "fails", UNDECIDED, "not run here", "not run yet")}
    for i, r in enumerate(rows, 1):
        out[r.test.verdict(tie) if r.test else r.missing.split(" (")[0]].append(i)
    return out


def summary(name: str, rows: list[Row], tie: float = TIE) -> str:
    """One line per table: how many rows hold, tie, fail, lack seeds or were not run, and which."""
    parts = []
    for word, idx in counts(rows, tie).items():
        if idx:
            tags: dict[str, list[str]] = {}
            for i in idx:
                tags.setdefault(rows[i - 1].short, []).extend([rows[i - 1].tag] if rows[i - 1].tag else [])
            shown = [f"{short} ({', '.join(t)})" if t else short for short, t in tags.items()]
            plural = {"holds": "hold", "fails": "fail", UNDECIDED: f"with {UNDECIDED}"}.get(word, word)
            parts.append(f"{len(idx)} {plural}: {'; '.join(shown)}")
    row_word = "row" if len(rows) == 1 else "rows"
    return f"- **{name}**, {len(rows)} {row_word}. " + ". ".join(parts) + "."


def unpaired(rows: list[Row]) -> list[int]:
    """The rows whose verdict rests on a difference with an unpaired SE (its arms do not share their seeds)."""
    return [i for i, r in enumerate(rows, 1) if r.test is not None and r.test.se > 0 and r.test.unpaired]


def notes(tables: dict[str, list[Row]]) -> str:
    """What the standard errors are, and which rows' are not paired."""
    loose = []
    for name, rows in tables.items():
        if idx := unpaired(rows):
            loose.append(f"{name}'s row{'s' * (len(idx) > 1)} {', '.join(map(str, idx))}")
    return (
        "Standard errors are paired: where the two sides of a comparison ran the same seeds of one sweep (each seed's "
        "arms start from the same pretrained base and the same clients), the margin is taken seed by seed and its "
        "SE is that of the per-seed differences, as on the privacy and LoRA pages (`tools/paired_seeds.py`); a run "
        "against its own round 0 is paired the same way. "
        + (f"Unpaired (sqrt(SE_a^2 + SE_b^2)): {'; '.join(loose)}. " if loose else "Every SE here is paired. ")
        + f'A row with an arm of one seed has no SE and gets no verdict ("{UNDECIDED}").'
    )


def markdown(tie: float = TIE) -> str:
    flite, fmp, own = flite_rows(), fmp_rows(), own_rows()
    return "\n".join(
        [
            "Made by `python tools/claims.py --markdown docs/results/claims.md` from the CSVs in docs/results/; the "
            "rule is in the tool's docstring.",
            "",
            "In short:",
            "",
            summary("FLITE", flite, tie),
            summary("FMP", fmp, tie),
            summary("Our own questions", own, tie),
            "",
            notes({"FLITE": flite, "FMP": fmp, "our own questions": own}),
            "",
            "**FLITE** (arXiv 2607.18343; abstract, sections 5.1-5.9, appendix B):",
            "",
            table(flite, tie),
            "",
            "**FMP** (Table I, Figs. 2-3, Proposition 1):",
            "",
            table(fmp, tie),
            "",
            "**Our own questions** (neither paper makes these claims; the same rule):",
            "",
            table(own, tie),
            "",
        ]
    )


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--markdown", type=Path, help="also write the tables to this file")
    parser.add_argument("--tie", type=float, default=TIE, help=f"tied within this many standard errors ({TIE:g})")
    args = parser.parse_args(argv)
    text = markdown(args.tie)
    if args.markdown:
        args.markdown.write_text(text)
    print(text, end="")
    return text


if __name__ == "__main__":
    main()
