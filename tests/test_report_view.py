"""What a person reads in `slmedge report`: every row of every table named, plots coloured by
method family with legends outside the data, and no Pareto front drawn from a single point."""

import re

import pytest
from typer.testing import CliRunner

from slmedge.cli import app
from slmedge.evaluate.store import ResultsStore
from slmedge.study import report

runner = CliRunner()


@pytest.fixture(scope="module")
def main_job_store(tiny_models, tmp_path_factory):
    """The main job's store: `slmedge run` writes two plain evaluations (the base in torch, the
    compressed GGUF in llama.cpp), no study."""
    tmp = tmp_path_factory.mktemp("main-job")
    db = tmp / "results.sqlite"
    res = runner.invoke(app, ["run", str(tiny_models("llama")), "--nsamples", "2", "--seqlen", "16", "--limit", "2",
                              "--results-db", str(db), "-o", str(tmp / "awq")])
    assert res.exit_code == 0, res.output
    return db


def test_a_plain_evaluation_store_names_every_row_of_every_table(main_job_store, tmp_path):
    store = ResultsStore(main_job_store)
    try:
        rows = report.load_rows(store)
        tables = report.tables(rows)
    finally:
        store.close()
    assert len(rows) == 2
    names = {r["name"] for r in rows}
    assert names == {"llama · torch · cpu", "awq.gguf · llama.cpp · cpu"}, names
    best = [t for t in tables if t["title"].startswith("Best under")]
    assert {t["title"] for t in best} == {"Best under a size budget on cpu", "Best under a speed floor on cpu"}
    for t in tables:
        for row in t["rows"]:
            if t in best:  # the winners' cells: "NAME (runtime): value", never "-: 0.1214"
                for cell in row[2:]:
                    assert cell == "–" or re.fullmatch(r"(llama \(torch\)|awq\.gguf \(llama\.cpp\)): [\d.e+-]+", cell), \
                        (t["title"], cell)
            else:
                assert row[0] in names, (t["title"], row)
    # The same in the files a person opens.
    out = tmp_path / "r.md"
    res = runner.invoke(app, ["report", str(main_job_store), "--format", "md", "-o", str(out)])
    assert res.exit_code == 0, res.output
    text = out.read_text()
    assert "| - " not in text and "-: " not in text
    assert "awq.gguf (llama.cpp): " in text


def _rows():
    """A study's rows of each family on one target, as load_rows gives them (no store needed)."""
    def row(method, family, bits, size_mb, tps, ppl, kl):
        labels = {"model": "m", "method": method, "export": "GGUF", "format": "gguf", "target": "cpu"}
        return {"study": "s", "labels": labels, "run_id": 0, "runtime": "llama.cpp", "threads": 2,
                "compression_bits": bits, "level": None, "export": {"bytes": size_mb * 1e6}, "facts": {},
                "family": family, "target": "cpu", "emulated": False, "settings": {},
                "metrics": {"perplexity": {"en": ppl, "th": ppl * 0.4, "zh": ppl * 0.6}, "kl_mean": {"wikitext2": kl},
                            "decode_tps": {"": tps}, "file_bytes": {"": size_mb * 1e6}},
                "name": f"m · {method} · GGUF · cpu"}

    return [row("base", "base", 16.0, 270, 45, 17.0, 0.0), row("awq-w4", "quantize", 4.6, 98, 70, 20.6, 0.17),
            row("wanda-50", "prune", 8.0, 270, 44, 47.1, 0.89), row("sparsegpt-50-w4", "both", 4.6, 98, 72, 60.0, 1.1)]


def _figures(monkeypatch, rows):
    """The report's figures, kept open (title -> figure) instead of turned into PNGs."""
    import matplotlib

    matplotlib.use("Agg")
    figs = []
    monkeypatch.setattr(report, "_fig_png", lambda fig: figs.append(fig) or b"png")
    captions = [c for c, _ in report.plots(rows)]
    return dict(zip(captions, figs))


def _overlaps(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def test_perplexity_plot_tells_the_families_apart_and_its_legends_leave_the_data_alone(monkeypatch):
    figs = _figures(monkeypatch, _rows())
    fig = figs["Perplexity against compression level, by method family and language"]
    ax = fig.axes[0]
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    legends = [a for a in ax.get_children() if type(a).__name__ == "Legend"]
    assert len(legends) == 2
    texts = {lg.get_title().get_text(): [t.get_text() for t in lg.get_texts()] for lg in legends}
    assert texts["family"] == ["base", "quantized", "pruned", "pruned + quantized"]
    assert texts["language"] == ["en", "th", "zh"]
    # One colour per family among the points.
    colours = {tuple(c) for coll in ax.collections for c in coll.get_facecolors()}
    assert len(colours) == 4
    for lg in legends:
        assert not _overlaps(lg.get_window_extent(renderer), ax.get_window_extent(renderer))


def test_no_pareto_front_from_one_point(monkeypatch):
    one = _rows()[:1]
    figs = _figures(monkeypatch, one)
    pareto = [f for c, f in figs.items() if c.startswith("Pareto front")]
    assert pareto
    for fig in pareto:
        labels = [t.get_text() for lg in [fig.axes[0].get_legend()] if lg for t in lg.get_texts()]
        assert "Pareto front" not in labels and not fig.axes[0].get_lines(), labels
    # Several points: the front is drawn, and its legend sits outside the axes.
    figs = _figures(monkeypatch, _rows())
    fig = figs["Pareto front on cpu: perplexity (geometric mean over the languages) against file size (MB)"]
    fig.canvas.draw()
    ax, lg = fig.axes[0], fig.axes[0].get_legend()
    assert "Pareto front" in [t.get_text() for t in lg.get_texts()]
    renderer = fig.canvas.get_renderer()
    assert not _overlaps(lg.get_window_extent(renderer), ax.get_window_extent(renderer))


def test_an_export_keeps_its_fidelity_after_its_artifact_is_discarded(tiny_models, tmp_path):
    """--discard-artifacts deletes an artifact once its export is written; the export's evaluation
    still compares it with the model it was made from (it used to find that model through the
    deleted artifact, and its fidelity, the report's KL columns and plots, went missing)."""
    from test_study import _study

    from slmedge.study.engine import run_study
    from slmedge.study.spec import load_study

    methods = ['method = "none"', 'label = "rtn-w4"\nmethod = "rtn"\nbits = 4\ngroup_size = 32']
    f = _study(tmp_path, tiny_models("llama"), name="disc", methods=methods, exports=('"gguf"',))
    store = ResultsStore(tmp_path / "disc.sqlite")
    try:
        counts = run_study(load_study(f), store, discard_artifacts=True)
        assert counts["failed"] == 0 and counts["discarded_bytes"] > 0
        assert not any((tmp_path / "work-disc" / "artifacts").iterdir())
        rows = {r["labels"]["method"]: r for r in report.load_rows(store, "disc")}
    finally:
        store.close()
    kl = rows["rtn-w4"]["metrics"].get("kl_mean")
    assert kl and 0 < next(iter(kl.values())) < 1, rows["rtn-w4"]["metrics"].keys()
