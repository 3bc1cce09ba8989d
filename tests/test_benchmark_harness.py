"""The benchmarks' shared harness (`benchmarks/harness.py`): its command line (common flags, option tables,
--quick), the output check against a reference mode, the table and the report writer. No model, no timing."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

# loaded from its file: the benchmarks folder is not a package and stays off sys.path (its scripts' names are generic)
_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "harness.py")
_SPEC = importlib.util.spec_from_file_location("benchmarks_harness", _PATH)
h = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(h)


def test_parser_common_flags_option_table_and_quick(tmp_path):
    p = h.parser("Doc line.\n\nmore", {"--sizes": ("1,2", "rows"), "--fast": False, "--rate": 0.5,
                                      "--mode": ("a", None, ("a", "b")), "--limit": None}, prompts=10, repeats=3)
    args = h.parse(p, ["--out", str(tmp_path)])
    assert (args.prompts, args.repeats, args.sizes, args.fast, args.rate, args.mode, args.limit) == (
        10, 3, "1,2", False, 0.5, "a", None)
    assert args.out_dir == str(tmp_path) and not args.quick
    quick = h.parse(p, ["--quick", "--out", str(tmp_path)], quick=dict(prompts=1, sizes="1"))
    assert (quick.prompts, quick.sizes, quick.repeats) == (1, "1", 3)
    given = h.parse(p, ["--quick", "--prompts", "4", "--out", str(tmp_path)], quick=dict(prompts=1, sizes="1"))
    assert (given.prompts, given.sizes) == (4, "1")
    for bad in (["--quick", "--write-docs"], ["--prompts", "0", "--out", str(tmp_path)], ["--mode", "c"]):
        with pytest.raises(SystemExit):
            h.parse(p, bad)
    assert h.int_list(p, "4,8", "--blocks") == [4, 8]
    with pytest.raises(SystemExit):
        h.int_list(p, "4,x", "--blocks")
    assert h.command("x.py", args, dict(prompts=10, repeats=2)) == "python benchmarks/x.py --repeats 3 --write-docs"
    with pytest.raises(SystemExit, match="split:seed"):
        h.prompt_sets(None, "dev:1", 1, 8)


def test_outputs_compare_every_run_with_the_reference_in_any_order():
    out = h.Outputs("plain")
    out.start()
    for mode, result in (("fast", [1, 2]), ("plain", [1, 2]), ("bad", [1, 3]), ("plain", [1, 2]), ("fast", [1, 2])):
        out.see(mode, 0, result)
    assert out.lossless == {"fast": True, "plain": True, "bad": False} and out.expected == [1, 2]
    assert [r for r in out.first["fast"]] == [[1, 2]]
    out.start()
    out.see("plain", 0, [5])
    with pytest.raises(SystemExit, match="disagrees with itself"):
        out.see("plain", 1, [6])
    timings = h.paired_items(["a", "b"], lambda item: {"plain": lambda: [item], "same": lambda: [item]}, 2,
                             outputs=h.Outputs("plain"))
    assert len(timings) == 2 and h.rate(timings, "same", 10, "cpu") > 0


def test_table_and_report_writer_keep_the_reading(tmp_path):
    assert h.table(["", "a"], [[1, 2.5]], align="lr") == ["| | a |", "|:---|---:|", "| 1 | 2.5 |"]
    report = h.Report(str(tmp_path), "bench")
    report.write({"x": 1}, ["# title", "body"], image="a figure")  # no figure drawn: no image line
    assert json.loads((tmp_path / "bench.json").read_text()) == {"x": 1}
    md = (tmp_path / "bench.md").read_text()
    assert md == "# title\nbody\n"
    (tmp_path / "bench.md").write_text(md + h.READING_MARK + "\nhand-written\n")
    report.markdown(["# title", "new body"])
    assert (tmp_path / "bench.md").read_text() == f"# title\nnew body\n\n{h.READING_MARK}\nhand-written\n"
    with h.workdir(type("A", (), {"workdir": None, "keep": False})(), "harness_test_") as work:
        assert os.path.isdir(work)
    assert not os.path.exists(work)
