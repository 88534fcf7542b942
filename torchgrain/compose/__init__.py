"""Composed datasets: concatenations, weighted mixtures, filters, subsets and splits.

Each is a view (a :class:`~torchgrain.Source`) over other datasets, wrapped in a
:class:`~torchgrain.Dataset`, so transforms, samplers, workers and the frameworks work on
it as on any dataset: ``tg.concat``, ``tg.mix``, ``tg.split``, ``Dataset.filter`` and
``Dataset.select``.
"""
