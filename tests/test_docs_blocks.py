"""The docs without an engine: how code blocks are found (what tests/test_docs.py runs), the
pages' static rules, the generated references against the code, and the site's strict build."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from importlib.resources import files
from pathlib import Path

import pytest

from edgeq.core import protocol
from edgeq.testing import docs
from edgeq.testing.docs import CodeBlock, code_blocks, doc_pages

REPO = Path(__file__).resolve().parents[1]


# --- code_blocks ---------------------------------------------------------------------------------


def test_blocks_their_lines_languages_and_text() -> None:
    page = "# Title\n\n```python\nprint(1)\n```\n\ntext\n\n~~~sh\necho hi\n~~~\n"
    assert code_blocks(page, "p.md") == [
        CodeBlock("p.md", 3, "python", "print(1)\n"),
        CodeBlock("p.md", 9, "sh", "echo hi\n"),
    ]
    assert [block.id for block in code_blocks(page, "p.md")] == ["p.md:3", "p.md:9"]


def test_an_untagged_block_and_the_kinds() -> None:
    page = "```\nplain\n```\n```json\n{}\n```\n```console\nls\n```\n```text\nout\n```\n"
    kinds = [block.kind for block in code_blocks(page, "p.md")]
    assert kinds == ["untagged", "json", "shell", "shown"]


def test_a_skip_marker_on_the_line_before_the_fence() -> None:
    page = (
        "<!-- docs-test: skip: needs a GPU box -->\n```sh\nnvidia-smi\n```\n\n"
        "<!-- docs-test: skip: too far away -->\n\n```sh\nedgeq status\n```\n"
    )
    first, second = code_blocks(page, "p.md")
    assert first.skip == "needs a GPU box"
    assert second.skip is None  # a blank line between marker and fence: not its marker


def test_a_misspelt_marker_is_an_error_not_a_silent_run() -> None:
    (block,) = code_blocks("<!-- docs-test: skp: GPU -->\n```sh\nls\n```\n", "p.md")
    assert block.skip is None
    assert block.marker_error is not None and "docs-test: skip: REASON" in block.marker_error


def test_indented_fences_longer_fences_and_info_strings() -> None:
    page = (
        "1. Step:\n\n    ```python title=\"x.py\"\n    if True:\n        print(1)\n    ```\n"
        "````markdown\n```python\nnot a block of its own\n```\n````\n"
    )
    first, second = code_blocks(page, "p.md")
    assert (first.language, first.code) == ("python", "if True:\n    print(1)\n")
    assert second.language == "markdown"
    assert second.code == "```python\nnot a block of its own\n```\n"


def test_an_unclosed_fence_runs_to_the_end() -> None:
    (block,) = code_blocks("```sh\necho a\necho b\n", "p.md")
    assert block.code == "echo a\necho b\n"


def test_the_pages_read_are_the_docs_and_readme() -> None:
    names = [name for name, _ in doc_pages(REPO)]
    assert names[-1] == "README.md"
    assert "reference/settings.md" in names


def test_json_blocks_that_are_wire_messages_are_checked_against_the_models() -> None:
    done = {"job_id": "j", "seq": 2, "type": "done", "finish_reason": "stop",
            "usage": {"prompt_tokens": 1, "completion_tokens": 1},
            "timings": {"queued_ms": 1, "ttft_ms": 2, "total_ms": 3}}  # fmt: skip
    request = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    result = {k: v for k, v in done.items() if k not in {"seq", "type"}} | {"text": "Hi"}
    record = {"t": 1, "f": "chat", "a": [request], "k": {}, "et": 1, "s": True, "r": result,
              "st": 2, "ft": 3, "q": "edgeq:queue", "id": "j"}  # fmt: skip
    assert docs.check_wire_json(done) == "done event"
    assert docs.check_wire_json(request) == "chat request"
    assert docs.check_wire_json(record) == "arq result record"
    assert docs.check_wire_json({"model": "m", "messages": []}) is None  # an OpenAI request
    assert docs.check_wire_json([1, 2]) is None
    for wrong in (
        {**done, "seq": -1},
        {**request, "temperature": 9},
        {**record, "r": {"job_id": "j", "text": "no usage"}},  # r: the outcome, checked
        {**record, "r": {**result, "outcome": "x"}, "s": False},
    ):
        with pytest.raises(ValueError):
            docs.check_wire_json(wrong)


# --- the pages' static rules (what test_docs.py checks without running anything) ------------


def test_every_block_is_tagged_every_marker_well_formed_every_json_block_parses() -> None:
    problems = []
    for name, path in doc_pages(REPO):
        for block in code_blocks(path.read_text(), name):
            if block.marker_error:
                problems.append(f"{block.id}: {block.marker_error}")
            elif block.kind == "untagged":
                problems.append(f"{block.id}: a fenced block without a language tag")
            elif block.kind == "json" and not block.skip:
                try:
                    docs.check_wire_json(json.loads(block.code))
                except json.JSONDecodeError as error:
                    problems.append(f"{block.id}: json that does not parse: {error}")
                except ValueError as error:  # pydantic's ValidationError is one
                    problems.append(f"{block.id}: not what the wire contract sends: {error}")
    assert problems == []


# --- links -------------------------------------------------------------------------------------

#: Pages a reader opens where they are (a code host, a checkout), besides docs/**/*.md.
TOP_PAGES = ("README.md", "CHANGELOG.md", "SECURITY.md")
_FENCE = re.compile(r"^\s*(```|~~~)")
_INLINE_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def prose(text: str) -> str:
    """A page without its fenced blocks and inline code: where its links are."""
    kept, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            kept.append(_INLINE_CODE.sub("", line))
    return "\n".join(kept)


def relative_links(text: str) -> list[str]:
    """The targets of a page's Markdown links that are paths (no scheme, no bare anchor)."""
    targets = [match[1] for match in _LINK.finditer(prose(text))]
    return [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t) and t[0] != "#"]


def test_relative_links_are_found_outside_code() -> None:
    page = (
        "[a](docs/a.md) [b](b.md#part \"title\") [c](https://x.org/) [d](#here)\n"
        "[e](mailto:x@y.org) `[f](not/a/link.md)`\n```md\n[g](in/a/block.md)\n```\n"
    )
    assert relative_links(page) == ["docs/a.md", "b.md#part"]


def test_every_relative_link_in_readme_and_docs_names_a_file_that_exists() -> None:
    """README and the top-level pages are read on a code host or in a checkout, not in the
    site: a link there is a path to a file of the repository (issue #44)."""
    pages = [path for _, path in doc_pages(REPO)]
    pages += [REPO / name for name in TOP_PAGES if (REPO / name).is_file()]
    broken = [
        f"{path.relative_to(REPO)}: {target}"
        for path in pages
        for target in relative_links(path.read_text())
        if not (path.parent / target.split("#")[0]).exists()
    ]
    assert broken == []


def test_no_link_to_an_unpublished_site() -> None:
    """No copy of the docs is published: an address of one (the unclaimed Read the Docs
    name README used to link) is a dead page, or anyone's page once the name is taken."""
    texts = [path for _, path in doc_pages(REPO)]
    texts += [REPO / name for name in (*TOP_PAGES, "mkdocs.yml", "pyproject.toml")]
    found = [
        f"{path.relative_to(REPO)}:{number}"
        for path in texts
        if path.is_file()
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if "readthedocs" in line
    ]
    assert found == []
    assert not re.search(r"(?m)^site_url:", (REPO / "mkdocs.yml").read_text())


# --- generated references ------------------------------------------------------------------------


def test_the_generated_references_are_what_the_code_makes_now() -> None:
    stale = [str(path) for path in docs.stale_files(REPO)]
    assert stale == [], f"generated files differ from the code: {stale}; run make docs-generate"


def test_the_schemas_in_the_package_are_the_models_schemas() -> None:
    shipped = files("edgeq.core") / "schemas"
    models = {
        "chat-request.json": protocol.ChatRequest,
        "delta-event.json": protocol.DeltaEvent,
        "done-event.json": protocol.DoneEvent,
        "error-event.json": protocol.ErrorEvent,
        "chat-result.json": protocol.ChatResult,
    }
    for name, model in models.items():
        assert json.loads((shipped / name).read_text()) == model.model_json_schema(), name
    names = {entry.name for entry in shipped.iterdir() if entry.name.endswith(".json")}
    assert names == set(docs.SCHEMAS)


def test_a_shipped_schema_checks_a_real_request_and_events() -> None:
    import jsonschema

    shipped = files("edgeq.core") / "schemas"
    request = protocol.ChatRequest(messages=[{"role": "user", "content": "hi"}], max_tokens=8)
    jsonschema.validate(
        request.model_dump(mode="json", exclude_none=True),
        json.loads((shipped / "chat-request.json").read_text()),
    )
    event = protocol.ErrorEvent(job_id="j", seq=3, code="cancelled", message="Cancelled.")
    schema = json.loads((shipped / "stream-event.json").read_text())
    jsonschema.validate(json.loads(protocol.encode_event(event)), schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"job_id": "j", "seq": -1, "type": "delta", "text": "x"}, schema)


def test_every_settings_class_is_in_the_settings_reference() -> None:
    """A new settings class (say, the producer's own) must be added to settings_groups."""
    sources = [*(REPO / "src").rglob("*.py")]
    for folder in ("worker", "gateway", "producer", "bench", "deploy"):
        sources += (REPO / folder).rglob("*.py")
    declared = {
        match[1]
        for path in sources
        for match in re.finditer(r"(?m)^class (\w+)\((?:\w+Settings)\)", path.read_text())
    }
    assert declared == {group.cls.__name__ for group in docs.settings_groups()}


def test_env_example_comments_are_the_lines_just_above_a_setting() -> None:
    text = (
        "# header\n\n# --- Knob 1 ---\n# What A is.\n# More on A.\n# EDGEQ_A=1\n# EDGEQ_B=\n"
        "\n# EDGEQ_C=2\n"
    )
    assert docs.env_example_comments(text) == {"EDGEQ_A": "What A is. More on A."}


def test_the_cli_reference_lists_every_command() -> None:
    from edgeq.cli import COMMANDS

    text = (REPO / "docs/reference/cli.md").read_text()
    for names in COMMANDS.values():
        for name in names:
            assert f"\n## edgeq {name}\n" in text, name


def test_generate_check_and_write(tmp_path: Path) -> None:
    """``--check`` says which file is stale; a run writes them all, after which --check is
    happy (on a copy: the checkout is left alone)."""
    (tmp_path / "deploy").mkdir()
    (tmp_path / "deploy/edgeq.env.example").write_text((REPO / docs.ENV_EXAMPLE).read_text())
    (tmp_path / docs.SCHEMA_DIR).mkdir(parents=True)
    (tmp_path / docs.SCHEMA_DIR / "gone.json").write_text("{}")
    command = [sys.executable, "-m", "edgeq.testing.docs", "--repo", str(tmp_path)]
    check = subprocess.run([*command, "--check"], capture_output=True, text=True, timeout=120)
    assert check.returncode == 1
    assert "stale: docs/reference/settings.md (run make docs-generate)" in check.stdout
    assert "src/edgeq/core/schemas/gone.json" in check.stdout
    subprocess.run(command, check=True, capture_output=True, timeout=120)
    assert not (tmp_path / docs.SCHEMA_DIR / "gone.json").exists()
    assert subprocess.run([*command, "--check"], timeout=120).returncode == 0


# --- the site ---------------------------------------------------------------------------------


def test_the_site_builds_strict(tmp_path: Path) -> None:
    """`make docs`: a broken link or anchor, or a page left out of the nav, is a failure."""
    mkdocs = Path(sys.executable).parent / "mkdocs"
    completed = subprocess.run(
        [str(mkdocs), "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    warnings = [line for line in completed.stderr.splitlines() if "WARNING" in line]
    assert completed.returncode == 0, "\n".join(warnings) or completed.stderr[-3000:]
    assert warnings == []
    assert (tmp_path / "site/reference/schemas/chat-request.json").is_file()
