"""Sphinx configuration: MyST notebooks executed at build time, numpydoc API reference."""

from __future__ import annotations

import portable_attn

project = "portable_attn"
author = "portable_attn developers"
copyright = "2026, portable_attn developers"
release = version = portable_attn.__version__

extensions = [
    "myst_nb",
    "numpydoc",
    "sphinx.ext.autodoc",
]
exclude_patterns = ["_build", "jupyter_execute", ".jupyter_cache", "github"]  # github: render.py
html_theme = "pydata_sphinx_theme"
html_title = "portable_attn"
html_theme_options = {"show_toc_level": 2}

# every example runs at build time; an error in one fails the build
nb_execution_mode = "force"
nb_execution_raise_on_error = True
nb_execution_timeout = 600
nb_merge_streams = True
myst_enable_extensions = ["dollarmath", "colon_fence"]

numpydoc_show_class_members = False
numpydoc_xref_param_type = False
autodoc_typehints = "none"
