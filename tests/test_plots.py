"""The speed-quality frontier plot: the Pareto selection, what the figure draws, and the PNG as a user opens it."""

from __future__ import annotations

import json
import random
import re

import numpy as np
import pytest

from blockgen.harness.reports import plots
from blockgen.harness.reports.leaderboard import Row
from blockgen.harness.reports.plots import color, pareto_front, speed_quality_frontier

TASK, MODEL = "embedded_wordproblems", "gsm-masked-mix"
AR_GREEDY = (0.60, 40.0)  # accuracy, tokens/s


def gen_row(sampler: str, nfe: int, temperature: float | None, value: float, tokens_per_s: float | None, *,
            model: str = MODEL, published: bool = False, steps: int | None = None,
            block_sizes: list[int] | None = None) -> Row:
    ar = plots.is_ar(sampler)
    return Row(model=model, task=TASK, metric="exact_match", value=value, stderr=0.02, n=500, higher_is_better=True,
               published=published, prior="masked", block_sizes=block_sizes, sampler=sampler, steps=steps or nfe, ge=1, warmup=0,
               temperature=temperature, block_size=1 if ar else 16, nfe_per_block=nfe, tokens_per_s=tokens_per_s,
               hardware="CPU: test")


def sweep() -> list[Row]:
    """Three samplers at NFE 4, 8, 16 and two temperatures, AR greedy and sampled, all with a measured speed."""
    rows = [gen_row("ar_greedy", 1, 1.0, *AR_GREEDY)]
    rows += [gen_row("ar_sample", 1, t, 0.50 - 0.1 * (t == 1.0), 39.0) for t in (1.0, 0.1)]
    for sampler, quality in (("ancestral", 0.30), ("eipc", 0.40), ("arpc", 0.50)):
        for nfe in (4, 8, 16):
            for t in (1.0, 0.1):
                value = quality + 0.02 * np.log2(nfe) + (0.05 if t == 0.1 else 0.0)
                rows.append(gen_row(sampler, nfe, t, value, 16 * 40.0 / nfe / (1.4 if sampler == "arpc" else 1.0)))
    return rows


# ------------------------------------------------------------------------------ the Pareto frontier


def test_pareto_front_of_a_hand_made_set():
    points = [(10, 50), (20, 40), (20, 45), (40, 30), (5, 50), (30, 20), (40, 30)]
    # (5, 50) is beaten by (10, 50): as accurate and faster; (20, 40) by (20, 45); (30, 20) by (40, 30);
    # the two equal (40, 30) do not beat each other
    assert pareto_front(points) == [0, 2, 3, 6]
    assert pareto_front([]) == [] and pareto_front([(1.0, 2.0)]) == [0]
    assert pareto_front([(1, 1), (2, 2), (3, 3)]) == [2]  # one point beats all the others


def test_pareto_front_is_a_staircase_that_covers_every_point():
    rng = random.Random(0)
    for _ in range(50):
        points = [(rng.randint(1, 20), rng.randint(0, 20)) for _ in range(rng.randint(1, 30))]
        front = [points[i] for i in pareto_front(points)]
        assert all(a[0] <= b[0] and a[1] >= b[1] for a, b in zip(front, front[1:]))  # faster is never more accurate
        # every point has a frontier point at least as fast and at least as accurate
        assert all(any(fx >= x and fy >= y for fx, fy in front) for x, y in points)
        # the frontier's points are exactly the best accuracy at their speed or above
        for x, y in front:
            assert y == max(py for px, py in points if px >= x)


# ------------------------------------------------------------------------------ what the figure draws


@pytest.fixture
def drawn(monkeypatch):
    """The axes of each figure, captured just before it is written."""
    axes = []
    save = plots._save

    def capture(plt, fig, path):
        axes.append((path.name, fig.axes[0]))
        return save(plt, fig, path)

    monkeypatch.setattr(plots, "_save", capture)
    return axes


def test_frontier_draws_the_reference_line_and_the_pareto_line(tmp_path, drawn):
    rows = sweep()
    (path,) = speed_quality_frontier(rows, tmp_path)
    assert path.name == f"frontier_{TASK}_{MODEL}.png"
    (name, ax), = drawn
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "ancestral", "eipc", "arpc", "ar_sample", "T = 1", "T = 0.1", "95% of AR greedy", "AR greedy (reference)",
        "Pareto frontier"]
    assert ax.get_xscale() == "log"
    dashed = [line for line in ax.lines if line.get_linestyle() == "--"]
    (reference,) = dashed
    assert np.allclose(reference.get_ydata(), 95 * AR_GREEDY[0])  # axhline: 95% of AR greedy, in percent
    points = [(r.tokens_per_s, 100 * r.value) for r in rows]
    expected = [points[i] for i in pareto_front(points)]
    (frontier,) = [line for line in ax.lines if line.get_linestyle() == "-" and len(line.get_xdata()) == len(expected)
                   and line.get_marker() in (None, "None", "")]
    assert np.allclose(np.column_stack([frontier.get_xdata(), frontier.get_ydata()]), expected)
    # every non-reference point is labelled with its NFE per block
    labels = [t.get_text() for t in ax.texts]
    assert sorted(labels) == sorted([str(r.nfe_per_block) for r in rows if r.sampler != "ar_greedy"] + ["AR greedy"])


def test_frontier_png_opens_and_shows_every_sampler_colour(tmp_path):
    import matplotlib.colors
    import matplotlib.image

    (path,) = speed_quality_frontier(sweep(), tmp_path)
    image = matplotlib.image.imread(path)[..., :3]
    assert image.shape[0] > 400 and image.shape[1] > 700 and image.std() > 0.05  # drawn, not blank
    for sampler in ("ancestral", "eipc", "arpc"):
        colour = np.array(matplotlib.colors.to_rgb(color(sampler)))
        near = np.abs(image - colour).max(axis=-1) < 0.03
        assert near.sum() > 30, sampler  # markers of that sampler's colour are on the image
    assert len(np.unique((image * 255).round().astype(np.uint8).reshape(-1, 3), axis=0)) > 20


def test_no_figure_without_measured_speed_or_for_published_rows(tmp_path):
    untimed = [gen_row("arpc", nfe, 0.1, 0.4, None) for nfe in (4, 8)] + [gen_row("ar_greedy", 1, 1.0, 0.6, None)]
    published = [gen_row("arpc", 4, 0.1, 0.4, 100.0, model="paper-model", published=True)]
    assert speed_quality_frontier(untimed + published, tmp_path) == []
    assert list(tmp_path.iterdir()) == []
    # one figure per (task, model) that has timed rows: the untimed model gets none
    timed = [gen_row("arpc", 4, 0.1, 0.4, 100.0, model="timed-model")]
    assert [p.name for p in speed_quality_frontier(untimed + published + timed, tmp_path)] == [f"frontier_{TASK}_timed-model.png"]


def test_the_page_lists_the_frontier_png(tmp_path):
    from blockgen.harness.reports.page import build_page

    page = build_page(sweep(), tmp_path / "site")
    data = json.loads(re.search(r'<script type="application/json" id="leaderboard-data">(.*?)</script>',
                                page.read_text(), re.S).group(1))
    assert f"frontier_{TASK}_{MODEL}.png" in data["plots"]
    assert (page.parent / f"frontier_{TASK}_{MODEL}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_accuracy_vs_nfe_is_scaled_to_the_data_with_error_bars(tmp_path, monkeypatch):
    """Accuracies of 34-65 % fill the axis (not 0-65 %, where every line looks flat), each sampler's
    line carries +-1 s.e. bars, and AR greedy's line a band."""
    drawn = []
    real_save = plots._save

    def keep(plt, fig, path):
        drawn.extend((ax.get_ylim(), [c.lines[0].get_color() for c in ax.containers], len(ax.patches)) for ax in fig.axes)
        return real_save(plt, fig, path)

    monkeypatch.setattr(plots, "_save", keep)
    (png,) = plots.accuracy_vs_nfe(sweep(), tmp_path)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and len(drawn) == 2  # one panel per temperature
    for (low, high), colours, bands in drawn:
        assert 20 < low < 34 and 65 < high < 80
        assert sorted(colours) == sorted(color(s) for s in ("ancestral", "eipc", "arpc"))  # error bars per sampler
        assert bands == 2  # AR greedy and AR sampled: +-1 s.e.


def test_accuracy_vs_nfe_draws_the_ar_model_at_each_panels_temperature(tmp_path, monkeypatch):
    """A panel's AR lines: the AR model's greedy (it reads no temperature) and its samples at the panel's
    temperature, never a mixture decoded at block size 1; the paper's AR rows (no temperature) in each panel."""
    mixture, ar_model = [1, 16], [1]
    rows = [gen_row("ancestral", nfe, t, 0.30 + 0.01 * nfe, None, block_sizes=mixture) for nfe in (4, 8) for t in (1.0, 0.1)]
    rows += [gen_row("ar_greedy", 1, 1.0, 0.61, None, model="gsm-ar", block_sizes=ar_model),
             gen_row("ar_sample", 1, 1.0, 0.42, None, model="gsm-ar", block_sizes=ar_model),
             gen_row("ar_sample", 1, 0.1, 0.58, None, model="gsm-ar", block_sizes=ar_model),
             gen_row("ar_greedy", 1, 1.0, 0.70, None, block_sizes=mixture),  # the mixture's, better: not the AR line
             gen_row("ar_sample", 1, None, 0.50, None, model="paper-ar", block_sizes=ar_model, published=True)]
    panels = {}
    real_save = plots._save

    def keep(plt, fig, path):
        for ax in fig.axes:
            lines = {line.get_label(): line.get_ydata()[0] for line in ax.lines if line.get_linestyle() == ":"}
            panels[ax.get_title()] = (lines, len(ax.patches))
        return real_save(plt, fig, path)

    monkeypatch.setattr(plots, "_save", keep)
    (png,) = plots.accuracy_vs_nfe(rows, tmp_path)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    expected = {"T = 1": {"gsm-ar ar_greedy": 61, "gsm-ar ar_sample": 42, "paper-ar ar_sample (paper)": 50},
                "T = 0.1": {"gsm-ar ar_greedy": 61, "gsm-ar ar_sample": 58, "paper-ar ar_sample (paper)": 50}}
    assert panels.keys() == expected.keys()
    for title, want in expected.items():
        lines, bands = panels[title]
        assert lines == pytest.approx(want), title
        assert bands == 2  # +-1 s.e. of this project's two AR lines; the paper's rows carry none


def test_genppl_plot_tells_two_models_of_one_sampler_apart(tmp_path, drawn):
    """Colour per sampler, marker per model; the temperature labels sit beside their points, not on them."""
    from blockgen.harness.reports.plots import genppl_vs_entropy

    rows = []
    for model, ppl in (("owt-masked-mix", 60.0), ("owt-uniform-mix", 90.0)):
        for t in (0.8, 1.0):
            common = dict(model=model, task="owt_genppl_embedded", published=False, prior="masked", sampler="arpc", steps=6,
                          ge=3, warmup=0, block_size=16, nfe_per_block=8, temperature=t, seed=0)
            rows.append(Row(metric="gen_ppl", value=ppl * t, higher_is_better=False, **common))
            rows.append(Row(metric="unigram_entropy", value=5.0 + t, higher_is_better=True, **common))
    (path,) = genppl_vs_entropy(rows, tmp_path)
    (name, ax), = drawn
    curves = [line for line in ax.lines if len(line.get_xdata()) == 2]
    assert len(curves) == 2 and len({line.get_color() for line in curves}) == 1  # one sampler: one colour
    assert len({line.get_marker() for line in curves}) == 2  # two models: two markers
    assert {t.get_text() for t in ax.get_legend().get_texts()} == {"owt-masked-mix arpc NFE 8", "owt-uniform-mix arpc NFE 8"}
    assert all(text.get_text().startswith("T") and text.xyann != (0, 0) and text.anncoords == "offset points"
               for text in ax.texts)


def test_a_one_row_accuracy_plot_is_readable(tmp_path, drawn):
    """One setting alone: a y axis of at least MIN_ACCURACY_SPAN points around it, and the model in its legend."""
    from blockgen.harness.reports.plots import MIN_ACCURACY_SPAN, accuracy_vs_nfe

    (path,) = accuracy_vs_nfe([gen_row("arpc", 4, 1.0, 0.42, None)], tmp_path)
    (name, ax), = drawn
    low, high = ax.get_ylim()
    assert high - low >= MIN_ACCURACY_SPAN - 1e-9 and low <= 42 <= high and low >= 0
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [f"{MODEL} arpc masked"]
