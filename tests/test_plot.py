"""`andrea plot`: the image is the right size and really shows the runs; bad input is exit 2."""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET

import numpy as np
import pytest
from conftest import andrea_main, assert_user_error
from test_runs import dead_pid, end_record, normal_history, start_record, write_run

from andrea.errors import UserError
from andrea.plot import _legend_name, _log_helps, draw_figure, plot_runs

pytest.importorskip("matplotlib", reason="matplotlib is the optional [plot] extra")
from PIL import Image  # noqa: E402  (Pillow comes with matplotlib)

# matplotlib's first two default colours: the first and second run.
BLUE, ORANGE = (0x1F, 0x77, 0xB4), (0xFF, 0x7F, 0x0E)


def two_runs(root):
    """Run a finished at 100; run b, a different model, crashed at 60 mid-write."""
    a = write_run(root, "a", [start_record(), *normal_history(100), end_record(100, "finished")])
    b_records = normal_history(60)
    for r in b_records:
        if r["event"] == "train":
            r.update(loss=r["loss"] + 0.5, lr=r["lr"] / 2, tokens_per_s=r["tokens_per_s"] * 1.5,
                     grad_norm=r["grad_norm"] * 3)
        else:
            r["val_loss"] += 0.5
    b = write_run(root, "b", [start_record(pid=dead_pid()), *b_records],
                  tail='{"event": "train", "step": 70, "lo')
    return a, b


def count_colour(pixels: np.ndarray, rgb: tuple[int, int, int]) -> int:
    return int((np.abs(pixels[..., :3].astype(int) - rgb).max(axis=-1) <= 8).sum())


def test_png_shows_both_runs(tmp_path):
    a, b = two_runs(tmp_path)
    warnings = []
    out = plot_runs([a, b], tmp_path / "new" / "dir" / "curves.png", warn=warnings.append)
    assert out == tmp_path / "new" / "dir" / "curves.png"  # missing folders were created
    assert warnings == [f"{b / 'metrics.jsonl'}: skipped 1 unreadable line(s); plotting the rest"]
    assert [p.name for p in out.parent.iterdir()] == ["curves.png"]  # no temp file left behind

    img = Image.open(out)
    assert img.format == "PNG" and img.size == (1300, 850)
    pixels = np.asarray(img.convert("RGB"))
    assert pixels.std() > 20  # not blank
    assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 50  # lines, text, anti-aliasing
    # Each run is drawn in its own colour in all four panels: thousands of pixels each.
    assert count_colour(pixels, BLUE) > 1000
    assert count_colour(pixels, ORANGE) > 500
    # Each quadrant (panel) holds some of each run's colour.
    h, w = pixels.shape[0] // 2, pixels.shape[1] // 2
    for quadrant in (pixels[:h, :w], pixels[:h, w:], pixels[h:, :w], pixels[h:, w:]):
        assert count_colour(quadrant, BLUE) > 100 and count_colour(quadrant, ORANGE) > 60


SVG = "{http://www.w3.org/2000/svg}"


def read_svg(path) -> ET.Element:
    """The SVG's tree with its comments: matplotlib draws text as glyph paths and keeps each
    string as a comment in its group."""
    return ET.parse(path, ET.XMLParser(target=ET.TreeBuilder(insert_comments=True))).getroot()


def loss_x_axis(root: ET.Element) -> tuple[list[str], str]:
    """The loss panel's (the first axes') x axis: its tick labels and its label."""
    def text(group: ET.Element) -> str:
        return next(node.text.strip() for node in group.iter() if node.tag is ET.Comment)

    axis = root.find(f".//{SVG}g[@id='axes_1']/{SVG}g[@id='matplotlib.axis_1']")
    groups = axis.findall(f"{SVG}g")
    ticks = [text(g) for g in groups if g.get("id").startswith("xtick_")]
    (label,) = [text(g) for g in groups if g.get("id").startswith("text_")]
    return ticks, label


def test_svg_and_step_axis(tmp_path):
    a, _ = two_runs(tmp_path)  # train records at steps 10, 20, ..., 100, 512 tokens a step
    root = read_svg(plot_runs([a], tmp_path / "curves.svg", x="step"))
    assert root.tag == f"{SVG}svg"
    assert root.get("width") == "936pt" and root.get("height") == "612pt"  # 13 x 8.5 in
    assert len(root.findall(f".//{SVG}path")) > 20
    # The loss panel counts steps: ticks across the run's steps 10..100, and named so.
    ticks, label = loss_x_axis(root)
    assert label == "optimizer step"
    steps = [float(t) for t in ticks]
    assert steps == sorted(steps) and steps[0] <= 20 and 100 <= steps[-1] < 200, ticks
    # By tokens (the default), the same run's axis runs to 51,200 tokens seen.
    ticks, label = loss_x_axis(read_svg(plot_runs([a], tmp_path / "tokens.svg")))
    assert label == "tokens seen" and ticks[-1].endswith(" k"), ticks


def test_bad_input(tmp_path, monkeypatch):
    a, _ = two_runs(tmp_path)
    with pytest.raises(UserError, match="unknown image type '.jpg'"):
        plot_runs([a], tmp_path / "x.jpg")
    (tmp_path / "pictures").mkdir()  # an existing folder: named as one, not as a file type
    with pytest.raises(UserError, match="pictures: is a folder; give a file name such as"):
        plot_runs([a], tmp_path / "pictures")
    with pytest.raises(UserError, match="--x time"):
        plot_runs([a], tmp_path / "x.png", x="time")
    with pytest.raises(UserError, match="no such run"):
        plot_runs([tmp_path / "nope"], tmp_path / "x.png")
    # A file where a folder goes: said as train says it, not as mkdir's "File exists".
    blocker = tmp_path / "file"
    blocker.write_text("")
    for out in (blocker / "x.png", blocker / "sub" / "x.png"):
        with pytest.raises(UserError) as refused:
            plot_runs([a], out)
        assert str(refused.value) == (f"{out}: cannot write there: {blocker} is a file, not a "
                                      f"folder; move it away or choose another folder")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    with pytest.raises(UserError, match=r"pip install -e '.\[plot\]'"):
        plot_runs([a], tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


def test_a_run_of_one_logged_step_shows_its_point_on_every_panel(tmp_path):
    """A line of one point draws nothing: a run of one logged step (max_steps below twice
    log_every) had empty panels. Each of its four series now draws a dot."""
    import matplotlib.pyplot as plt
    from test_runs import train_record

    one = write_run(tmp_path, "one", [start_record(), train_record(1), end_record(1, "finished")])
    fig = draw_figure([one], warn=lambda _: None)
    try:
        lone = [line for ax in fig.axes for line in ax.get_lines() if len(line.get_xdata()) == 1]
        assert len(lone) == 4  # train loss, learning rate, tokens/s, gradient norm
        assert all(line.get_marker() not in ("None", "", None) for line in lone), lone
    finally:
        plt.close(fig)


def test_the_val_curve_breaks_at_a_resume_onto_a_new_val_set(tmp_path):
    """Before: the val losses before and after a resume onto a new val set (its start's
    new_val_set: train.eval_tokens changed, a mixture reweighted) were joined in one dashed
    curve, as if comparable. Now each val set has its own, a mixture's sources' likewise (each
    source once in the legend); a resume onto the same set keeps one curve."""
    import matplotlib.pyplot as plt

    def val_lines(run):
        fig = draw_figure([run], x="step", warn=lambda _: None)
        try:
            lines = fig.axes[0].get_lines()
            return ([list(line.get_xdata()) for line in lines if line.get_linestyle() == "--"],
                    [(list(line.get_xdata()), line.get_label()) for line in lines
                     if line.get_linestyle() == ":"])
        finally:
            plt.close(fig)

    def history(new_val_set):
        resumed = {**start_record(100, max_steps=200), "new_val_set": new_val_set}
        records = [start_record(max_steps=200), *normal_history(100), end_record(100, "stopped"),
                   resumed, *normal_history(200, 100), end_record(200, "finished")]
        for rec in records:
            if rec["event"] == "eval":
                rec["val_sources"] = {"a": {"loss": 3.1}, "b": {"loss": 3.2}}
        return records

    new = write_run(tmp_path, "new", history(["train.eval_tokens 2048 -> 256"]))
    dashed, dotted = val_lines(new)
    assert dashed == [[50, 100], [150, 200]]
    assert [xs for xs, _ in dotted] == [[50, 100], [50, 100], [150, 200], [150, 200]]
    assert [label for _, label in dotted][:2] == ["new (finished): val a", "new (finished): val b"]
    assert not any(label.startswith("new") for _, label in dotted[2:])  # each source named once
    same = write_run(tmp_path, "same", history(None))
    assert val_lines(same)[0] == [[50, 100, 150, 200]]


def test_plot_cli(tmp_path):
    a, b = two_runs(tmp_path)
    empty = write_run(tmp_path, "empty", [])
    # A run with nothing readable is left out with a warning; the others are plotted.
    proc = andrea_main("plot", str(a), str(b), str(empty), "--out", str(tmp_path / "p.png"))
    assert proc.returncode == 0, proc.stderr
    assert "skipped 1 unreadable line(s)" in proc.stderr
    assert "empty/metrics.jsonl: no train or eval records; run left out" in proc.stderr
    assert Image.open(tmp_path / "p.png").size == (1300, 850)
    # Nothing readable at all: exit 2, one line, no file.
    proc = andrea_main("plot", str(empty), "--out", str(tmp_path / "q.png"))
    assert_user_error(proc, "nothing to plot")
    assert not (tmp_path / "q.png").exists()
    assert_user_error(andrea_main("plot", str(a), "--out", str(tmp_path / "q.gif")), "q.gif")


def test_plot_of_a_folder_that_is_no_run_says_what_to_give(tmp_path):
    """Before: an empty folder, or the folder of runs `andrea runs` takes, was refused with
    "no metrics.jsonl in this folder; is it a run directory?": a question, not what to do."""
    (tmp_path / "empty").mkdir()
    out = str(tmp_path / "p.png")
    assert_user_error(andrea_main("plot", str(tmp_path / "empty"), "--out", out),
                      f"{tmp_path / 'empty'}: not a run", "give a run's folder, e.g. runs/<name>")
    two_runs(tmp_path / "runs")
    assert_user_error(andrea_main("plot", "runs", "--out", out, cwd=tmp_path),
                      "runs: a folder of runs, not one run; name the runs to plot, e.g. runs/a")
    assert_user_error(andrea_main("plot", str(tmp_path / "nope"), "--out", out), "no such run")
    assert not (tmp_path / "p.png").exists()


def test_an_imported_run_is_left_out_with_a_note(tmp_path):
    from test_runs import imported_run

    a, _ = two_runs(tmp_path)
    imp = imported_run(tmp_path)
    proc = andrea_main("plot", str(a), str(imp), "--out", str(tmp_path / "p.png"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines() == [
        f"warning: {imp}: no metrics.jsonl (an imported run, not trained yet); run left out"]
    pixels = np.asarray(Image.open(tmp_path / "p.png").convert("RGB"))
    assert count_colour(pixels, BLUE) > 1000 and count_colour(pixels, ORANGE) == 0
    assert_user_error(andrea_main("plot", str(imp), "--out", str(tmp_path / "q.png")),
                      "nothing to plot", "an imported run")
    assert not (tmp_path / "q.png").exists()


def test_titles_and_offset_texts_fit_and_do_not_overlap(tmp_path):
    """The loss panel's key (once one line wider than its panel) stays inside the figure and
    clear of the learning-rate panel's title and its "1e-3" offset text, with long run names
    (whose legends narrow the panels) as well."""
    from matplotlib.pyplot import close
    from matplotlib.text import Text

    a, b = two_runs(tmp_path)
    long = write_run(tmp_path, "a-run-name-long-enough-to-make-its-legend-entries-wide" * 2,
                     [start_record(), *normal_history(100), end_record(100, "finished")])
    # A mixture's sources are named by their paths as configured, which can be long too.
    sources = ("/home/someone/corpora/wikipedia-en-2024-11-01-cleaned-and-deduplicated/",
               "/home/someone/corpora/the-stack-python-permissive-deduplicated-v2/")
    history = normal_history(100)
    for r in history:
        if r["event"] == "eval":
            r["val_sources"] = {name: {"loss": r["val_loss"] + i / 10, "tokens": 1000,
                                       "weight": 0.5} for i, name in enumerate(sources)}
    mixture = write_run(tmp_path, "mixture", [start_record(), *history,
                                              end_record(100, "finished")])
    for runs in ([a], [a, b, long], [a, mixture]):
        fig = draw_figure(runs, warn=lambda _: None)
        try:
            fig.canvas.draw()
            renderer = fig.canvas.get_renderer()
            figure_box = fig.bbox
            header = [t for t in fig.findobj(Text) if t.get_text() == fig.get_suptitle()]
            for ax in fig.axes:
                header += [ax.title, ax.xaxis.get_offset_text(), ax.yaxis.get_offset_text()]
            boxes = {t.get_text(): t.get_window_extent(renderer)
                     for t in header if t.get_visible() and t.get_text()}
            assert "1e\u22123" in boxes  # the learning-rate panel's offset text is drawn
            for text, box in boxes.items():
                assert (figure_box.x0 <= box.x0 and box.x1 <= figure_box.x1
                        and figure_box.y0 <= box.y0 and box.y1 <= figure_box.y1), (text, box)
            texts = list(boxes)
            for i, first in enumerate(texts):
                for second in texts[i + 1:]:
                    assert not boxes[first].overlaps(boxes[second]), (first, second)
            # Each legend inside its panel: a long run or source name is shortened in the
            # middle, keeping the ends where the names differ.
            if mixture in runs:
                labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
                assert [label for label in labels if ": val " in label] == [
                    "mixture (finished): val wikipedia-en-20\u2026d-deduplicated",
                    "mixture (finished): val the-stack-pytho\u2026eduplicated-v2"]
            for ax in fig.axes:
                if ax.get_legend() is not None:
                    legend, panel = ax.get_legend().get_window_extent(renderer), ax.bbox
                    assert panel.x0 <= legend.x0 and legend.x1 <= panel.x1, (ax.get_title(),
                                                                             legend, panel)
        finally:
            close(fig)


def test_a_sources_legend_name_is_its_last_folder_where_that_tells_them_apart():
    from andrea.plot import _source_names

    assert _source_names(["data/wiki/", "/mnt/code"]) == {"data/wiki/": "wiki", "/mnt/code": "code"}
    # Two sources in folders of one name keep their paths.
    assert _source_names(["a/train", "b/train"]) == {"a/train": "a/train", "b/train": "b/train"}
    # Alike even once cut to fit: numbered in order.
    long = [f"/home/user/corpora/web/{v}/data/train-byte" for v in ("v1", "v2")]
    assert list(_source_names(long).values()) == ["1. /home/user/corp\u2026ata/train-byte",
                                                  "2. /home/user/corp\u2026ata/train-byte"]


def test_a_log_axis_only_for_positive_values_that_spread():
    """A log scale cannot show 0 or a negative value (matplotlib drops the point): a spread of
    positive values takes it, one value at or under 0 keeps the axis linear."""
    assert _log_helps([1.0, 100.0], 10)
    assert not _log_helps([1.0, 5.0], 10)
    assert not _log_helps([0.0, 1.0, 100.0], 10)
    assert not _log_helps([-1.0, 1.0, 100.0], 10)


def test_a_legend_name_of_the_limit_is_whole_and_a_longer_one_cut_in_the_middle():
    assert _legend_name("a" * 30) == "a" * 30
    cut = _legend_name("a" * 15 + "b" * 16)
    assert len(cut) == 30 and cut == "a" * 15 + "\u2026" + "b" * 14


def test_steps_a_resume_threw_away_are_not_drawn(tmp_path):
    """Died at step 150, resumed from 100: steps 110..150 of the first attempt led nowhere; the
    train curve draws each step once, the resumed ones."""
    import matplotlib.pyplot as plt

    records = [start_record(max_steps=200), *normal_history(150), start_record(100, max_steps=200),
               *normal_history(200, 100), end_record(200, "finished")]
    fig = draw_figure([write_run(tmp_path, "r", records)], x="step", warn=lambda _: None)
    try:
        train_line = fig.axes[0].get_lines()[0]
        assert list(train_line.get_xdata()) == list(range(10, 201, 10))
    finally:
        plt.close(fig)
