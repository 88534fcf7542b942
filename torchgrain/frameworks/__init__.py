"""What torchgrain knows about the frameworks it runs under, one module per framework.

torchgrain's samplers and datasets are told their context through public means: the
loader that iterates a sampler binds it (:func:`torchgrain.bind`, which
:class:`~torchgrain.ResumableLoader` calls), workers ask
:func:`torch.utils.data.get_worker_info`, and world size and rank come from
``torch.distributed`` or the launcher's environment. What a framework does not expose
publicly, and torchgrain still needs, lives here and nowhere else, each module tested
against the framework's real code:

* :mod:`torchgrain.frameworks.dataloader`: torch's ``DataLoader`` internals (which
  loader a batch is read for, a worker's result pipe, and the deprecated lookup of the
  loader that drives an unbound sampler).
* :mod:`torchgrain.frameworks.accelerate`: HF Accelerate's prepared loaders, which split
  batches between processes themselves.
* :mod:`torchgrain.frameworks.transformers`: a ``transformers.Trainer`` whose training
  loader is ordered by a torchgrain sampler (public Trainer API only).

PyTorch Lightning, Ray Train and torchrun need nothing here: Lightning keeps a
``DistributedSampler`` in place, and Ray's ``prepare_data_loader`` does too.
"""
