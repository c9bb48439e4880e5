"""Sphinx configuration of the course website (``make site``; see website/build.py).

website/build.py copies this file into the staged project (``_build/site-src/``) next to its
``site.json``, which says where the repository is (autodoc imports *its* ``gpucourse``).
"""

import json
import sys
from pathlib import Path

_site = json.loads((Path(__file__).resolve().parent / "site.json").read_text())
sys.path.insert(0, _site["root"])

project = "gpucourse"
author = "the gpucourse authors"
copyright = "the gpucourse authors, MIT licence"
html_title = "gpucourse — multi-GPU training on the laptop you have"
root_doc = "index"
language = "en"

extensions = ["myst_nb", "sphinx.ext.mathjax"]
if _site["api"]:
    extensions += ["sphinx.ext.autodoc", "sphinx.ext.napoleon"]

# the stored outputs are the page: nothing is executed, nothing is cached
nb_execution_mode = "off"
nb_merge_streams = True
# never load a widget manager (from a CDN): widgets are stored frozen (placeholder + still picture)
nb_ipywidgets_js = {}
myst_enable_extensions = ["dollarmath"]
myst_heading_anchors = 3

# MathJax 3 from the site itself (website/build.py copies it from the npm package into _static/)
mathjax_path = "mathjax/tex-chtml.js"
# \text{sec\_per\_row}: text-mode macros inside \text, as the notebooks write them
mathjax3_config = {"loader": {"load": ["[tex]/textmacros"]}, "tex": {"packages": {"[+]": ["textmacros"]}}}

# autodoc: the public names website/build.py lists per part, Google-style docstrings (napoleon)
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "sphinx_book_theme"
html_static_path = ["_static"]
html_css_files = ["site.css"]
html_favicon = "_static/favicon.svg"
# the theme's light/dark switch starts from the reader's system setting (empty: a console error)
html_context = {"default_mode": "auto"}
html_copy_source = False
html_show_sourcelink = False
html_last_updated_fmt = None
html_theme_options = {
    "home_page_in_toc": True,
    "show_navbar_depth": 1,
    "show_toc_level": 2,
    "use_download_button": False,
    "use_fullscreen_button": False,
    "use_source_button": False,
    "use_repository_button": False,
    "use_issues_button": False,
    "use_edit_page_button": False,
    "navigation_with_keys": False,
}
