"""Results as data: every table in the docs is regenerated from committed records or from the code.

A generated block in a Markdown file is two HTML comments around the table::

    <!-- generated: records experiments/<name>/runs/* columns=policy,settings,perplexity -->
    | ... the table ... |
    <!-- /generated -->

``python scripts/collect.py --docs`` (``make results``) rewrites every block of ``README.md``,
``docs/*.md`` and ``experiments/*/README.md``; ``--check`` only reports the blocks that differ (the docs
test runs it). A records block whose records are gone is dropped, markers included, unless its marker says
``pending`` (a place kept for an experiment not yet run), so no table outlives its data.
"""

from kvcompress.harness.docgen.blocks import DocsReport, markdown_files, regenerate

__all__ = ["DocsReport", "markdown_files", "regenerate"]
