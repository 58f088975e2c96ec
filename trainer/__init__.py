"""fctkit.trainer — server-side training and evaluation.

The evaluation core (:mod:`fctkit.trainer.evaluation`, :mod:`fctkit.trainer.report`) needs
numpy only; everything that trains needs the ``train`` extra (torch).
"""
