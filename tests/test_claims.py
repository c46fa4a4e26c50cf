"""tools/claims.py: the claims tables regenerate from the committed CSVs byte for byte, the results landing page and
README quote what it prints, and its verdict rule gives holds / tie / fails as worked out by hand."""

import csv
import math
import re

from conftest import REPO, tool_module

RESULTS = REPO / "docs" / "results"


def test_the_claims_tables_regenerate_from_the_csvs(tmp_path, capsys):
    """``python tools/claims.py --markdown docs/results/claims.md`` gives the committed file byte for byte."""
    out = tmp_path / "claims.md"
    printed = tool_module("claims").main(["--markdown", str(out)])
    capsys.readouterr()
    assert out.read_bytes() == (RESULTS / "claims.md").read_bytes(), (
        "docs/results/claims.md differs from what the CSVs give: "
        "python tools/claims.py --markdown docs/results/claims.md"
    )
    assert printed == out.read_text()


def table_rows(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("| ") and "---" not in line]


def test_the_results_page_and_readme_quote_the_tables_as_generated():
    """Every row of both tables appears verbatim in docs/results.md, and README carries the short version (one line
    per paper, rewrapped): a verdict or number edited by hand in a page, or a CSV that moves it, fails here."""
    committed = (RESULTS / "claims.md").read_text()
    rows = table_rows(committed)
    flite = [r for r in rows if "§" in r or "App. B" in r]
    assert len(flite) >= 20 and len(rows) - len(flite) >= 20, "both tables, FLITE's and FMP's"
    page = (REPO / "docs" / "results.md").read_text()
    assert [r for r in rows if r not in page] == []
    assert len(table_rows(page)) >= len(rows)
    short = [line for line in committed.splitlines() if line.startswith("- **")]
    assert [line.split("**")[1] for line in short] == ["FLITE", "FMP", "Our own questions"]
    readme = " ".join((REPO / "README.md").read_text().split())
    assert [line for line in short if " ".join(line.split()) not in readme] == []


def test_every_row_has_a_verdict_or_says_it_was_not_run():
    text = (RESULTS / "claims.md").read_text()
    verdicts = [row.rsplit(" | ", 1)[1] for row in table_rows(text)[1:] if not row.startswith("| # ")]
    assert verdicts and all(
        re.match(r"\*\*(holds|tie|fails)\*\* \((exact|[+-]\d+\.\d SE)", v)
        or v.startswith(("not run here", "not run yet (`python tools/sweep.py", "**not enough seeds** (an arm has one"))
        for v in verdicts
    ), verdicts


def tables(text: str) -> dict[str, list[str]]:
    """The rows of each table of claims.md, by its heading (``**FLITE** (...):``)."""
    out: dict[str, list[str]] = {}
    name = None
    for line in text.splitlines():
        if line.startswith("**") and line.endswith(":"):
            name = line.split("**")[1]
            out[name] = []
        elif name is not None and line in table_rows(line):
            out[name].append(line)
    return out


def test_no_verdict_rests_on_one_seed_and_the_llm_row_is_our_own_question():
    """A row with an arm of one seed says "not enough seeds"; SmolLM2's row (the FLITE paper has no LLM) sits in the
    table of our own questions, not in FLITE's, so README's count of FLITE's failures leaves it out."""
    found = tables((RESULTS / "claims.md").read_text())
    assert list(found) == ["FLITE", "FMP", "Our own questions"]
    assert not [r for r in found["FLITE"] + found["FMP"] if "SmolLM2" in r]
    assert [r for r in found["Our own questions"] if "SmolLM2" in r and "**not enough seeds**" in r]
    for row in (r for rows in found.values() for r in rows):
        if re.search(r"\(1 seed|\b1 / \d+ seeds", row):
            assert "**not enough seeds** (an arm has one seed" in row, row


def test_the_verdict_rule_on_a_hand_made_csv(tmp_path):
    """Two seeds per label; each seed's best accuracy over rounds 1 to R (round 0, the start, never counts).
    By hand: a = (0.5, 0.75): mean 0.625, SE = stdev / sqrt(2) = 0.17678 / 1.41421 = 0.125 (exact in binary);
    b = (0.375, 0.375), c = (0.5, 0.5), d = (0.875, 0.875), e = (0.4375, 0.4375): SE 0. So a - b = 0.25 = 2 SE
    (holds, on the boundary), a - e = 0.1875 = 1.5 SE (tie), a - c = 1 SE (tie), a - d = -2 SE (fails, on the
    boundary)."""
    claims = tool_module("claims")
    per_round = {  # label, seed: val/acc at rounds 0, 1, 2
        ("a", 0): (0.99, 0.5, 0.25),
        ("a", 1): (0.99, 0.5, 0.75),
        ("b", 0): (0.0, 0.375, 0.125),
        ("b", 1): (0.0, 0.25, 0.375),
        ("c", 0): (0.0, 0.5, 0.5),
        ("c", 1): (0.0, 0.5, 0.5),
        ("d", 0): (0.0, 0.875, 0.5),
        ("d", 1): (0.0, 0.5, 0.875),
        ("e", 0): (0.0, 0.4375, 0.0),
        ("e", 1): (0.0, 0.0, 0.4375),
    }
    path = tmp_path / "hand.csv"
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["label", "seed", "round", "final", "val/acc"])
        for (label, seed), accs in per_round.items():
            w.writerows([label, seed, k, int(k == 2), v] for k, v in enumerate(accs))
    rows = list(csv.DictReader(path.open(newline="")))
    a, b, c, d, e = (claims.best(rows, x) for x in "abcde")
    assert (a.mean, a.se, a.n) == (0.625, 0.125, 2)
    assert [(m.mean, m.se) for m in (b, c, d, e)] == [(0.375, 0.0), (0.5, 0.0), (0.875, 0.0), (0.4375, 0.0)]
    assert claims.final(rows, "a", "val/acc") == claims.Mean(0.5, 0.25, 2)  # the last round, (0.25, 0.75)

    def word(test, tie=2.0):
        return test.verdict(tie)

    # "A beats B": the difference, at 2 SE of it
    assert word(claims.beats(a, b)) == "holds" and claims.beats(a, b).k == 2.0  # +2 SE exactly: holds
    assert word(claims.beats(a, e)) == "tie" and claims.beats(a, e).k == 1.5
    assert word(claims.beats(a, c)) == "tie" and claims.beats(a, c).k == 1.0
    assert word(claims.beats(a, d)) == "fails" and claims.beats(a, d).k == -2.0  # -2 SE exactly: fails
    assert word(claims.beats(b, a)) == "fails"
    assert word(claims.beats(d, a, lower=True)) == "fails" and word(claims.beats(b, a, lower=True)) == "holds"
    assert word(claims.beats(a, e), tie=1.5) == "holds" and word(claims.beats(a, c), tie=1.5) == "tie"
    # symmetric: swapping the sides flips holds and fails, and a tie stays a tie
    for x in (b, c, d, e):
        flipped = {"holds": "fails", "fails": "holds", "tie": "tie"}[word(claims.beats(a, x))]
        assert word(claims.beats(x, a)) == flipped
    # "A matches B": the tolerance less |A - B| (0.125 here)
    assert word(claims.within(a, c, 0.375)) == "holds"  # 0.25: 2 SE
    assert word(claims.within(a, c, 0.25)) == "tie"  # 0.125: 1 SE
    assert word(claims.within(a, d, 0.125)) == "tie"  # 0.125 - 0.25: -1 SE
    assert word(claims.within(a, d, 0.0)) == "fails"  # -2 SE
    # "flat": the tolerance less the largest minus the smallest mean; both exact here, so the sign decides
    spread = {"b": b, "c": c, "d": d}
    assert (
        claims.flat(spread, 0.5) == claims.Test(0.0, 0.0, "d against b") and word(claims.flat(spread, 0.5)) == "holds"
    )
    assert word(claims.flat(spread, 0.375)) == "fails"
    # exact bytes: "1-2 orders of magnitude" is log10(ratio) - 1
    assert word(claims.Test(math.log10(10.0) - 1, 0.0)) == "holds"
    assert word(claims.Test(math.log10(9.99) - 1, 0.0)) == "fails"
    # several parts: the worst decides, and the cell names it
    parts = [claims.beats(a, b, "vs b"), claims.beats(a, e, "vs e"), claims.beats(a, c, "vs c")]
    assert claims.every(parts).where == "vs c" and word(claims.every(parts)) == "tie"
    assert claims.every([*parts, claims.beats(a, d, "vs d")]).where == "vs d"
    assert claims.verdict_cell(claims.every(parts)) == "**tie** (+1.0 SE, vs c)"
    assert claims.verdict_cell(claims.Test(0.5, 0.0, "bytes")) == "**holds** (exact, bytes)"
    assert claims.verdict_cell(None).startswith("not run here")


def test_differences_pair_seed_by_seed_and_one_seed_gives_no_verdict(tmp_path):
    """By hand, two seeds: a = (0.5, 0.75), b = (0.25, 0.625). Paired: the differences (0.25, 0.125) have mean 0.1875
    and SE stdev / sqrt(2) = 0.0625, so a beats b by 3 SE (holds); unpaired it would be 0.1875 over
    sqrt(0.125^2 + 0.1875^2) = 0.2253, 0.8 SE (a tie). The same values under another sweep do not pair; a label with
    one seed has no SE, and a comparison with it gets "not enough seeds"; an exact level keeps the pairing."""
    claims = tool_module("claims")
    per_round = {
        ("x", "a", 0): (0.0, 0.5),
        ("x", "a", 1): (0.0, 0.75),
        ("x", "b", 0): (0.0, 0.25),
        ("x", "b", 1): (0.0, 0.625),
        ("y", "b", 0): (0.0, 0.25),
        ("y", "b", 1): (0.0, 0.625),
        ("x", "one", 0): (0.0, 0.5),
    }
    path = tmp_path / "hand.csv"
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["sweep", "label", "seed", "round", "final", "val/acc"])
        for (sweep, label, seed), accs in per_round.items():
            w.writerows([sweep, label, seed, k, int(k == 1), v] for k, v in enumerate(accs))
    rows = list(csv.DictReader(path.open(newline="")))
    a, b = claims.best(rows, "a"), claims.best([r for r in rows if r["sweep"] == "x"], "b")
    other_b = claims.best([r for r in rows if r["sweep"] == "y"], "b")
    test = claims.beats(a, b)
    assert (test.margin, test.se, test.k, test.unpaired) == (0.1875, 0.0625, 3.0, False)
    assert test.verdict() == "holds" and claims.verdict_cell(test) == "**holds** (+3.0 SE)"
    loose = claims.beats(a, other_b)
    assert loose.unpaired and math.isclose(loose.se, math.hypot(0.125, 0.1875)) and loose.verdict() == "tie"
    one = claims.best(rows, "one")
    assert (one.mean, one.n) == (0.5, 1) and math.isnan(one.se)
    for undecided in (claims.beats(a, one), claims.within(one, b, 0.5, "one")):
        assert undecided.verdict() == "not enough seeds" and math.isnan(undecided.k)
    assert claims.verdict_cell(claims.within(one, b, 0.5, "one")) == "**not enough seeds** (an arm has one seed, one)"
    # a failing part decides before one without seeds; one without seeds before a tie
    fails = claims.beats(b, a, "b over a")
    assert claims.every([claims.beats(a, one, "one"), fails]).where == "b over a"
    assert claims.every([claims.beats(a, one, "one"), loose]).verdict() == "not enough seeds"
    level = claims.beats(a, claims.Mean(0.5, 0.0, 0))  # an exact level (the collapse line): a's own SE, still paired
    assert (level.margin, level.se, level.unpaired) == (0.125, 0.125, False)


def test_the_paper_budget_row_reads_its_sweep_within_the_budget_or_says_it_is_not_run(tmp_path, monkeypatch):
    """FLITE's claim 9 at the paper's budget (tools/sweeps/flite_budget_fashion_mnist.yaml): before its CSV exists
    the row says "not run yet" with the command; with it, the latent's best counts only the rounds whose bytes stay
    within FedAvg's one round (here 1,000 B: rounds 1-3 at 300 B each, not round 4's 0.99), paired per seed."""
    claims = tool_module("claims")
    monkeypatch.setattr(claims, "RESULTS", tmp_path)
    absent = claims.paper_budget_row()
    assert absent.test is None and absent.missing.startswith("not run yet (`python tools/sweep.py tools/sweeps/")
    assert (REPO / "tools" / "sweeps" / "flite_budget_fashion_mnist.yaml").is_file()
    assert "not run yet" in claims.table([absent]) and claims.counts([absent])["not run yet"] == [1]
    with (tmp_path / claims.BUDGET_CSV).open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["sweep", "label", "seed", "round", "final", "val/acc", "comm/cum_client_bytes"])
        for seed, (fed, lat) in enumerate([(0.5, (0.5, 0.625, 0.5, 0.99)), (0.5, (0.75, 0.5, 0.5, 0.99))]):
            w.writerows(
                [["b", "fedavg_dir0.5_R1_E1", seed, 0, 0, 0.25, 0], ["b", "fedavg_dir0.5_R1_E1", seed, 1, 1, fed, 1000]]
            )
            w.writerows(
                ["b", "latent_dir0.5_budget", seed, k, int(k == 4), v, 300 * k] for k, v in enumerate((0.25, *lat))
            )
    row = claims.paper_budget_row()
    assert row.test == claims.Test(0.1875, 0.0625) and row.test.verdict() == "holds"
    assert "latent 3 rounds (900 B) 0.6875 +/- 0.0625" in row.ours
