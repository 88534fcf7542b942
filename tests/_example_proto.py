"""tf.train.Example message classes built at runtime from a descriptor (test oracle).

Lets tests compare torchgrain's hand-written wire-format code with the protobuf
library's parser and serializer, without TensorFlow.
"""

from __future__ import annotations

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

_F = descriptor_pb2.FieldDescriptorProto


def _build():
    fdp = descriptor_pb2.FileDescriptorProto(
        name="torchgrain_test/example.proto", package="tgtest", syntax="proto3"
    )

    def msg(name, fields, nested=()):
        m = fdp.message_type.add(name=name)
        for n in nested:
            m.nested_type.add().CopyFrom(n)
        for f in fields:
            m.field.add().CopyFrom(f)
        return m

    def field(
        name, number, ftype, label=_F.LABEL_OPTIONAL, type_name=None, packed=None, oneof=None
    ):
        f = _F(name=name, number=number, type=ftype, label=label)
        if type_name:
            f.type_name = type_name
        if packed is not None:
            f.options.packed = packed
        if oneof is not None:
            f.oneof_index = oneof
        return f

    rep = _F.LABEL_REPEATED
    msg("BytesList", [field("value", 1, _F.TYPE_BYTES, rep)])
    msg("FloatList", [field("value", 1, _F.TYPE_FLOAT, rep, packed=True)])
    msg("Int64List", [field("value", 1, _F.TYPE_INT64, rep, packed=True)])
    feat = msg(
        "Feature",
        [
            field("bytes_list", 1, _F.TYPE_MESSAGE, type_name=".tgtest.BytesList", oneof=0),
            field("float_list", 2, _F.TYPE_MESSAGE, type_name=".tgtest.FloatList", oneof=0),
            field("int64_list", 3, _F.TYPE_MESSAGE, type_name=".tgtest.Int64List", oneof=0),
        ],
    )
    feat.oneof_decl.add(name="kind")
    entry = descriptor_pb2.DescriptorProto(name="FeatureEntry")
    entry.options.map_entry = True
    entry.field.add().CopyFrom(field("key", 1, _F.TYPE_STRING))
    entry.field.add().CopyFrom(field("value", 2, _F.TYPE_MESSAGE, type_name=".tgtest.Feature"))
    msg(
        "Features",
        [field("feature", 1, _F.TYPE_MESSAGE, rep, type_name=".tgtest.Features.FeatureEntry")],
        nested=[entry],
    )
    msg("Example", [field("features", 1, _F.TYPE_MESSAGE, type_name=".tgtest.Features")])
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return {
        name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"tgtest.{name}"))
        for name in ("Example", "Features", "Feature", "BytesList", "FloatList", "Int64List")
    }


_CLASSES = _build()
Example = _CLASSES["Example"]
Feature = _CLASSES["Feature"]


def to_python(example) -> dict:
    """Example message -> the representation decode_tf_example returns (unsqueezed)."""
    import numpy as np

    out = {}
    for key, feat in example.features.feature.items():
        kind = feat.WhichOneof("kind")
        if kind == "bytes_list":
            out[key] = list(feat.bytes_list.value)
        elif kind == "float_list":
            out[key] = np.array(feat.float_list.value, dtype=np.float32)
        elif kind == "int64_list":
            out[key] = np.array(feat.int64_list.value, dtype=np.int64)
        else:
            out[key] = []
    return out
