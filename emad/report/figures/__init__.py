"""The aggregate stage's curve figures (PNG): quality against cost, one line per family's sweep.

:mod:`.frontier` makes the figures (per series, overview, domain shift) from :mod:`.draw`'s axes-level pieces
and :mod:`.zoom`'s panels zoomed on the tolerance band;
:mod:`.lines` holds what a panel shows (quality scale, lines, limits, the same fields for ``dvc plots``) and
:mod:`.style` how each family looks.
"""
