"""The docs a user follows: every link, heading link and repository path they name exists, README
shows its first command early, docs/training.md stays a reference, and docs/model.md's parameter
table is the closed form of each preset and its table of `auto`'s attention is AUTO_TABLE."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import yaml

from andrea.config import load_config, resolve_path
from andrea.config.sections import key_specs
from andrea.model.params import closed_form_total

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# [text](target) and ![alt](target); the target up to a space, a '#' or the closing parenthesis.
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s#]*)(?:#[^)]*)?\)")
# A path inside the repository as the docs write it in prose or code: a top-level folder, then
# names, ending in a file suffix or a slash.
REPO_PATH = re.compile(
    r"(?<![\w./-])((?:andrea|tests|scripts|docs|configs|kernels)/(?:[\w./-]*?(?:\.\w+|/))?)"
    r"(?![\w/])"
)
# Paths the docs name on purpose although no checkout holds them: a run's or a prepared
# folder's files (made by running andrea), and placeholders.
NOT_IN_REPO = re.compile(r"NNNN|<|\*")
ANCHORED_LINK = re.compile(r"\]\(([^)\s#]*)#([^)\s]+)\)")


def relative_links(text: str) -> list[str]:
    return [t for t in LINK.findall(text) if t and not re.match(r"[a-z]+:", t)]


def repo_paths(text: str) -> set[str]:
    return {p.rstrip(".") for p in REPO_PATH.findall(text) if not NOT_IN_REPO.search(p)}


def test_the_patterns_catch_what_they_claim():
    text = ("see [the map](architecture.md#one-step), ![plot](quality.png), [site](https://x.org), "
            "`andrea/train/loop.py` and scripts/bench.py. Also `tests/` and step-NNNNNN/x.json")
    assert relative_links(text) == ["architecture.md", "quality.png"]
    assert repo_paths(text) == {"andrea/train/loop.py", "scripts/bench.py", "tests/"}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_relative_link_resolves(doc: Path):
    missing = [t for t in relative_links(doc.read_text()) if not (doc.parent / t).exists()]
    assert not missing, f"{doc.name} links to missing files: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_repository_path_named_exists(doc: Path):
    missing = sorted(p for p in repo_paths(doc.read_text()) if not (REPO / p).exists())
    assert not missing, f"{doc.name} names paths that are not in the repository: {missing}"


def test_readme_shows_the_first_command_within_its_first_20_lines():
    lines = (REPO / "README.md").read_text().splitlines()
    assert "<!-- main-command -->" in lines[:20]


def github_anchor(heading: str) -> str:
    """The id GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", doc.read_text(), flags=re.MULTILINE | re.DOTALL)
    return {github_anchor(h) for h in re.findall(r"^#+ (.+)$", text, re.MULTILINE)}


def test_github_anchor_drops_punctuation():
    assert github_anchor("2026-12-02: the README's commands (as run)") == \
        "2026-12-02-the-readmes-commands-as-run"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_link_to_a_heading_finds_it(doc: Path):
    broken = []
    for target, anchor in ANCHORED_LINK.findall(doc.read_text()):
        page = (doc.parent / target) if target else doc
        if page.suffix == ".md" and anchor not in anchors(page):
            broken.append(f"{target}#{anchor}")
    assert not broken, f"{doc.name} links to headings that do not exist: {broken}"


def test_model_doc_parameter_table_is_the_closed_form():
    rows = re.findall(r"^\| `(andrea-[\w.]+\.yaml)` \|.*\| ([\d,]+) \| ([\d,]+) \|$",
                      (REPO / "docs" / "model.md").read_text(), re.MULTILINE)
    presets = sorted(p.name for p in resolve_path("andrea-12m.yaml").parent.glob("andrea-*.yaml"))
    assert sorted(row[0] for row in rows) == presets
    for name, attention, total in rows:
        model = load_config(name).model
        assert int(attention.replace(",", "")) == model.n_layer * 4 * model.d_model**2, name
        assert int(total.replace(",", "")) == closed_form_total(model), name


def test_model_doc_auto_table_is_auto_table():
    from andrea.model.attention import AUTO_TABLE

    rows = re.findall(r"^\| (sm_\d+) \| (\w+) \| (\d+) \| (\w+) \| ([\d.]+)x \|$",
                      (REPO / "docs" / "model.md").read_text(), re.MULTILINE)
    assert {(arch, dtype, int(d)): (backend, float(ratio))
            for arch, dtype, d, backend, ratio in rows} == {
        key: (entry.backend, entry.kernels_vs_sdpa) for key, entry in AUTO_TABLE.items()}


def test_keys_tables_in_the_docs_state_the_declared_defaults():
    """A reference table that repeats a key's default (docs/training.md's Muon and spike-guard
    tables) says what the declaration says. docs/config.md is generated and checked elsewhere;
    docs/log.md records what was, and its tables are of recipes, not defaults."""
    declared = {spec.dotted: spec.default for spec in key_specs()}
    seen = 0
    for doc in DOCS:
        if doc.name in ("config.md", "log.md"):
            continue
        for dotted, default in re.findall(r"^\| `(\w+\.\w+)` \| `?([^`| ]+)", doc.read_text(),
                                          re.MULTILINE):
            if dotted in declared:
                seen += 1
                assert yaml.safe_load(default) == declared[dotted], (doc.name, dotted, default)
    assert seen >= 13


def package_names() -> dict[str, set[str]]:
    """Every module of the package (dotted) and what it defines at the top: functions, classes,
    their methods and fields (`Class.name`), assigned names, and the names it spells as strings
    (a metric's, a key's)."""
    names: dict[str, set[str]] = {}
    for path in (REPO / "andrea").rglob("*.py"):
        module = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        tree = ast.parse(path.read_text())
        defined = {node.value for node in ast.walk(tree)
                   if isinstance(node, ast.Constant) and isinstance(node.value, str)
                   and node.value.isidentifier()}
        for node in tree.body:
            if isinstance(node, ast.FunctionDef | ast.ClassDef):
                defined.add(node.name)
            if isinstance(node, ast.ClassDef):
                defined |= {f"{node.name}.{sub.name}" for sub in node.body
                            if isinstance(sub, ast.FunctionDef)}
                defined |= {f"{node.name}.{sub.target.id}" for sub in node.body
                            if isinstance(sub, ast.AnnAssign) and isinstance(sub.target, ast.Name)}
            elif isinstance(node, ast.Assign):
                defined |= {t.id for t in node.targets if isinstance(t, ast.Name)}
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                defined.add(node.target.id)
        names[module] = defined
    return names


def names_the_map_cannot_find(text: str, names: dict[str, set[str]]) -> list[str]:
    """The `module.name` and `snake_case` names in backticks that no module defines (the map
    shortens andrea.train.loop.train to `loop.train` or `train.loop.train`)."""
    keys = {spec.dotted for spec in key_specs()} | {spec.name for spec in key_specs()}
    everything = set().union(*names.values())
    missing = []
    for token in set(re.findall(r"`([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)`", text)):
        parts = token.split(".")
        if token in keys or token in everything or ("." not in token and "_" not in token):
            continue
        if any(f"{base}.{'.'.join(parts[:k])}" in names
               and ".".join(parts[k:]) in names[f"{base}.{'.'.join(parts[:k])}"] | {""}
               for k in range(1, len(parts) + 1)
               for base in ("andrea", "andrea.train", "andrea.data", "andrea.model", "andrea.cuda",
                            "andrea.config")):
            continue
        if not re.search(r"\.(py|cu|md|json|yaml)$", token):
            missing.append(token)
    return sorted(missing)


def test_the_map_check_finds_what_is_not_there():
    names = {"andrea.train.loop": {"train", "Session.step"}, "andrea.train": set()}
    text = "`loop.train`, `train.loop.train`, `Session.step`, `loop.gone`, `no_such_thing`, `x.py`"
    assert names_the_map_cannot_find(text, names) == ["loop.gone", "no_such_thing"]


def test_every_module_and_function_the_architecture_map_names_exists():
    text = (REPO / "docs" / "architecture.md").read_text()
    assert names_the_map_cannot_find(text, package_names()) == []


def test_the_python_example_runs_and_generates_as_its_table_says(tmp_path, data_dir, capsys,
                                                                  monkeypatch):
    """docs/python.md's example, run as a script's __main__: it trains, evaluates, generates
    and calls a verb. Its generate call passes what the table's row says (a call without
    n_valid drew the vocab padding, which decode refuses)."""
    import runpy

    text = (REPO / "docs" / "python.md").read_text()
    example = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    row = re.search(r"andrea\.generate\.generate\(model, prompt_ids, max_new_tokens, \.\.\., "
                    r"([^)]*)\)", text)
    assert row and " ".join(row.group(1).split()) in " ".join(example.split())
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "shakespeare-byte").symlink_to(data_dir)  # the preset's data.dir
    (tmp_path / "example.py").write_text(example)
    monkeypatch.chdir(tmp_path)
    runpy.run_path("example.py", run_name="__main__")
    assert capsys.readouterr().out.splitlines()[-1] == "exit 0"
