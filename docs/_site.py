"""mkdocs hooks (mkdocs.yml): the README is the site's home page and CONTRIBUTING.md a page of it, with their
links to `docs/...` and the docs' links to `../README.md` and `../CONTRIBUTING.md` pointing within the site."""

import re
from pathlib import Path

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).parent.parent
PAGES = {"README.md": "index.md", "CONTRIBUTING.md": "contributing.md"}


def _within_site(markdown: str, outside: bool) -> str:
    if outside:  # a page written at the repository's root, served from docs/
        markdown = re.sub(r"\]\(docs/", "](", markdown)
        markdown = markdown.replace("](CONTRIBUTING.md)", "](contributing.md)")
    for source, page in PAGES.items():
        markdown = markdown.replace(f"](../{source})", f"]({page})").replace(f"](../{source}#", f"]({page}#")
    return markdown


def on_files(files: Files, config) -> Files:
    for source, page in PAGES.items():
        text = _within_site((ROOT / source).read_text(), outside=True)
        files.append(File.generated(config, page, content=text))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    return _within_site(markdown, outside=False)
