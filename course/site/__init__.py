"""The course site: the READMEs, figures and executed notebooks built with MkDocs (``build``),
then opened in a headless Chromium (``check``). ``python -m course.site`` runs it. Imports
``labs`` and ``upstream``."""
