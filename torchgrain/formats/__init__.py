"""File formats, below the sources: readers and writers of bytes, no torch.

``arrayrecord_file`` (the native ArrayRecord reader), ``tfrecord`` (TFRecord framing),
``tf_example`` (``tf.train.Example`` without TensorFlow), ``tfds`` (TFDS feature specs),
``codecs`` (record bytes <-> dicts) and ``manifest`` (torchgrain's dataset manifest).
The sources in :mod:`torchgrain.sources` build on these.
"""
