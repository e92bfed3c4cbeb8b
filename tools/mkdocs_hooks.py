"""MkDocs hooks: the version in the site's name, the transformations table, and the
notebooks of ``notebooks/``.

The table of the JAX transformations each solver supports is rendered from
``tests/transform_claims.py`` (which ``tests/test_transform_claims.py`` checks against the
test suite) where a page has the line ``<!-- transforms-table -->``.

The notebooks are committed without outputs and are never executed by ``mkdocs build``.
``tests/test_notebooks.py`` executes each one and saves the executed copy, with its
figures, under ``build/notebooks/`` (with the SHA-256 of the source it ran). This hook
adds every ``notebooks/*.ipynb`` to the site as ``notebooks/<name>.ipynb`` (rendered by
mkdocs-jupyter): the executed copy where it was made from the current source, else the
source itself (code and text, no outputs).

The notebooks' formulas are typeset by MathJax 2, which this hook copies from the
``jupyter-server-mathjax`` package (the docs extra) into ``assets/mathjax/`` of the site:
the pages load it from there, never from a CDN.

A notebook page's table of contents is rebuilt from the headings of its rendered HTML:
mkdocs-jupyter builds it from a Markdown copy of the notebook with every inline code span
removed, so a heading such as "Custom JVPs with `jax.custom_jvp`" lost its code in the
table of contents and its link pointed to an anchor the page does not have.
"""

from __future__ import annotations

import hashlib
import html
import importlib.util
import json
import logging
import re
import shutil
from pathlib import Path

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File
from mkdocs.structure.toc import get_toc

log = logging.getLogger("mkdocs.hooks.notebooks")

ROOT = Path(__file__).resolve().parents[1]
SOURCE_DIR = ROOT / "notebooks"
EXECUTED_DIR = ROOT / "build" / "notebooks"
#: Key in an executed notebook's metadata: the SHA-256 of the source it was run from.
SOURCE_HASH_KEY = "implicit_solvers_source_sha256"


def on_config(config):
    """The package's version (pyproject.toml) after the site's name, on every page."""
    import tomllib

    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    config["site_name"] = f"{config['site_name']} {version}"
    return config


def source_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def notebook_to_render(source: Path) -> tuple[Path, bool]:
    """The file to render for ``source``, and whether it carries outputs."""
    executed = EXECUTED_DIR / source.name
    if executed.is_file():
        try:
            meta = json.loads(executed.read_text(encoding="utf-8")).get("metadata", {})
        except ValueError:
            meta = {}
        if meta.get(SOURCE_HASH_KEY) == source_sha256(source):
            return executed, True
    return source, False


@event_priority(100)  # before mkdocs-jupyter's on_files, which wraps the .ipynb files
def on_files(files, config):
    for source in sorted(SOURCE_DIR.glob("*.ipynb")):
        path, executed = notebook_to_render(source)
        log.info("notebook %s: %s", source.name, "with outputs" if executed else "no outputs")
        # A File with a real src_dir (not File.generated): mkdocs-jupyter's wrapper reads
        # abs_src_path from src_dir and src_uri.
        files.append(
            File(
                f"notebooks/{source.name}",
                src_dir=str(path.parent.parent),
                dest_dir=config["site_dir"],
                use_directory_urls=config["use_directory_urls"],
            )
        )
    return files


_HEADING = re.compile(r'<h([1-6])\s+id="([^"]+)"[^>]*>(.*?)</h\1>', re.DOTALL)
_ANCHOR_LINK = re.compile(r'<a class="anchor-link"[^>]*>.*?</a>', re.DOTALL)
_TAG = re.compile(r"<[^>]+>")


def notebook_toc_tokens(content: str) -> list[dict]:
    """Table-of-contents tokens (as Python-Markdown's toc extension makes them, nested by
    level) for the headings of a rendered notebook, with the ids the headings carry."""
    flat = []
    for level, anchor, inner in _HEADING.findall(content):
        text = html.unescape(_TAG.sub("", _ANCHOR_LINK.sub("", inner))).strip()
        flat.append({"level": int(level), "id": anchor, "name": html.escape(text),
                     "children": []})
    tokens: list[dict] = []
    stack: list[dict] = []
    for token in flat:
        while stack and stack[-1]["level"] >= token["level"]:
            stack.pop()
        (stack[-1]["children"] if stack else tokens).append(token)
        stack.append(token)
    return tokens


#: Where a page shows the transformations table (tests/transform_claims.py renders it).
TRANSFORMS_TABLE = "<!-- transforms-table -->"


def on_page_markdown(markdown, page, config, files):
    """The transformations table, rendered from the claims the test suite checks."""
    if TRANSFORMS_TABLE not in markdown:
        return markdown
    spec = importlib.util.spec_from_file_location(
        "transform_claims", ROOT / "tests" / "transform_claims.py")
    claims = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(claims)
    return markdown.replace(TRANSFORMS_TABLE, claims.render())


def on_page_content(html_content, page, config, files):
    if page.file.src_uri.startswith("notebooks/") and page.file.src_uri.endswith(".ipynb"):
        page.toc = get_toc(notebook_toc_tokens(html_content))
    return html_content


def on_post_build(config):
    # Located, not imported (importing it starts loading Jupyter Server).
    spec = importlib.util.find_spec("jupyter_server_mathjax")
    if spec is None:
        raise RuntimeError("the docs need jupyter-server-mathjax: pip install -e '.[docs]'")
    static = Path(spec.submodule_search_locations[0]) / "static"
    target = Path(config["site_dir"]) / "assets" / "mathjax"
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(static, target)
    # The package ships the STIX-Web fonts only (as Jupyter uses them): say so.
    (target / "config" / "local").mkdir(exist_ok=True)
    (target / "config" / "local" / "site.js").write_text(
        'MathJax.Hub.Config({"HTML-CSS": {availableFonts: [], preferredFont: null, '
        'webFont: "STIX-Web", imageFont: null}});\n'
        'MathJax.Ajax.loadComplete("[MathJax]/config/local/site.js");\n'
    )
