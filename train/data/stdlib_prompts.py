"""Coding prompts generated offline from the docstrings of the Python standard library.

A fixed list of pure-Python modules, their public functions with a usable docstring, a deterministic
selection (sorted by a hash of the qualified name), and a few phrasings of "implement this function".

Docstrings change between Python versions, so the default dataset reads the prompts written once, by Python
3.11, and shipped in builtin/stdlib_prompts.jsonl: every interpreter builds the same dataset (and finds the
same cached one). This module rewrote that file:

    python -m headway.train.data.stdlib_prompts > train/data/builtin/stdlib_prompts.jsonl
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import os
import re

MODULES = ("bisect", "base64", "calendar", "colorsys", "difflib", "fnmatch", "fractions", "ftplib", "glob",
           "heapq", "html", "ipaddress", "json", "keyword", "mimetypes", "ntpath", "os", "posixpath", "pprint",
           "quopri", "random", "shlex", "shutil", "statistics", "string", "tarfile", "textwrap", "tokenize",
           "urllib.parse", "uuid", "wave", "zipfile", "email.utils", "http.cookies", "locale", "gettext",
           "platform", "filecmp", "netrc", "copy", "dataclasses", "functools", "operator", "re", "csv")
PHRASINGS = (
    "Write a Python function `{sig}` that does the following:\n\n{doc}",
    "Implement `{sig}` in Python. Its documentation says:\n\n{doc}",
    "Here is the docstring of a Python function `{sig}`:\n\n{doc}\n\nWrite an implementation and explain it briefly.",
)


def _first_paragraph(doc: str) -> str:
    """The docstring's description: first paragraph, doctest lines removed, whitespace normalised."""
    para = inspect.cleandoc(doc).split("\n\n")[0]
    lines = [ln for ln in para.splitlines() if not ln.lstrip().startswith(">>>")]
    return re.sub(r"\s+", " ", " ".join(lines)).strip()


def _machine_specific(default) -> bool:
    """A default value that differs between machines or launchers (a filesystem path): a prompt showing
    it would change the default dataset's key, and a dataset built by `accelerate launch` (python3) would
    be rebuilt by `python`."""
    return isinstance(default, str) and any(sep in default for sep in (os.sep, os.altsep) if sep)


def _candidates() -> list[tuple[str, str, str]]:
    """(qualified name, signature, description) for public stdlib functions with a usable docstring."""
    out = {}
    for name in MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:  # removed in newer Pythons (e.g. uu in 3.13): skip, selection stays deterministic
            continue
        for fname, fn in inspect.getmembers(module, inspect.isfunction):
            if fname.startswith("_") or fn.__module__ != module.__name__ or not fn.__doc__:
                continue
            doc = _first_paragraph(fn.__doc__)
            try:
                signature = inspect.signature(fn)
            except (TypeError, ValueError):
                continue
            if any(_machine_specific(p.default) for p in signature.parameters.values()):
                continue  # e.g. platform.architecture(executable=<this interpreter's path>)
            sig = f"{fname}{signature}"
            if 40 <= len(doc) <= 500 and len(sig) <= 80:
                out.setdefault(doc, (f"{module.__name__}.{fname}", sig, doc))  # one prompt per description
    return sorted(out.values())


def stdlib_coding_prompts(n: int) -> list[dict]:
    """n deterministic prompts: {"id", "category": "coding", "prompt", "source"}."""
    ranked = sorted(_candidates(), key=lambda c: hashlib.sha1(c[0].encode()).hexdigest())[:n]
    return [{"id": f"stdlib-{qual}", "category": "coding", "source": qual,
             "prompt": PHRASINGS[i % len(PHRASINGS)].format(sig=sig, doc=doc)}
            for i, (qual, sig, doc) in enumerate(ranked)]


if __name__ == "__main__":
    for prompt in stdlib_coding_prompts(100):
        print(json.dumps(prompt))
