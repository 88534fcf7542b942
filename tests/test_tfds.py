"""Reading `tfds build --file_format=array_record` output without TensorFlow.

The fixture mirrors a TFDS version directory: dataset_info.json and features.json in
TFDS's JSON layout, and `NAME-SPLIT.array_record-0000i-of-0000n` shards of serialized
tf.train.Example written with the C++ ArrayRecordWriter.
"""

from __future__ import annotations

import io
import json
import os
import shutil

import numpy as np
import pytest
import torch

import torchgrain as tg
from torchgrain.formats.tf_example import TFExampleCodec, encode_tf_example
from torchgrain.formats.tfds import TFDSCodec
from torchgrain.formats.tfrecord import write_tfrecord

PIL = pytest.importorskip("PIL.Image")

NAME = "toy_digits"
FC = "tensorflow_datasets.core.features."


def _tensor(dtype, shape, encoding="none", cls="tensor_feature.Tensor"):
    t = {"shape": {"dimensions": [str(d) for d in shape]} if shape else {}, "dtype": dtype}
    t["encoding"] = encoding
    return {"pythonClassName": FC + cls, "tensor": t}


FEATURES = {
    "pythonClassName": FC + "features_dict.FeaturesDict",
    "featuresDict": {
        "features": {
            "image": {
                "pythonClassName": FC + "image_feature.Image",
                "image": {
                    "shape": {"dimensions": ["8", "8", "1"]},
                    "dtype": "uint8",
                    "encodingFormat": "png",
                },
            },
            "photo": {
                "pythonClassName": FC + "image_feature.Image",
                "image": {"shape": {"dimensions": ["-1", "-1", "3"]}, "dtype": "uint8"},
            },
            "label": {
                "pythonClassName": FC + "class_label_feature.ClassLabel",
                "classLabel": {"numClasses": "10"},
            },
            "id": _tensor("int64", [], cls="scalar.Scalar"),
            "embedding": _tensor("float32", [2, 3]),
            "mask": _tensor("bool", [4]),
            "packed": _tensor("uint8", [3, 2], encoding="bytes"),
            "caption": {"pythonClassName": FC + "text_feature.Text", "text": {}},
            "metadata": {
                "pythonClassName": FC + "features_dict.FeaturesDict",
                "featuresDict": {
                    "features": {
                        "source": _tensor("string", []),
                        "score": _tensor("float64", []),
                    }
                },
            },
            "frames": {
                "pythonClassName": FC + "dataset_feature.Dataset",
                "sequence": {"feature": _tensor("int32", [2]), "length": "-1"},
            },
        }
    },
}


def _png(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    PIL.fromarray(arr.squeeze(-1) if arr.shape[-1] == 1 else arr).save(buf, format="PNG")
    return buf.getvalue()


def make_example(k: int) -> tuple[dict, bytes]:
    """The decoded record TFDS would yield, and its serialized tf.train.Example."""
    rng = np.random.default_rng(k)
    image = rng.integers(0, 255, (8, 8, 1), dtype=np.uint8)
    photo = rng.integers(0, 255, (3 + k % 2, 5, 3), dtype=np.uint8)
    emb = rng.standard_normal((2, 3)).astype(np.float32)
    mask = np.array([k % 2 == 0, True, False, k % 3 == 0])
    packed = rng.integers(0, 255, (3, 2), dtype=np.uint8)
    frames = np.arange(2 * (k % 3), dtype=np.int32).reshape(-1, 2) + k
    expected = {
        "image": image,
        "photo": photo,
        "label": np.int64(k % 10),
        "id": np.int64(1000 + k),
        "embedding": emb,
        "mask": mask,
        "packed": packed,
        "caption": f"digit nº{k}",
        "metadata": {"source": f"src{k}".encode(), "score": np.float64(np.float32(k / 3))},
        "frames": frames,
    }
    flat = {
        "image": _png(image),
        "photo": _png(photo),
        "label": k % 10,
        "id": 1000 + k,
        "embedding": emb,
        "mask": mask.astype(np.int64),
        "packed": packed.tobytes(),
        "caption": f"digit nº{k}",
        "metadata/source": f"src{k}".encode(),
        "metadata/score": np.float32(k / 3),
        "frames": frames.ravel().astype(np.int64),
    }
    return expected, encode_tf_example(flat)


def build_tfds_dir(root, *, fmt="array_record", splits=(("train", [6, 4]), ("test", [3]))):
    """A TFDS-like version directory; returns (directory, {split: expected records})."""
    from array_record.python.array_record_module import ArrayRecordWriter

    d = root / NAME / "1.0.0"
    d.mkdir(parents=True)
    expected: dict[str, list[dict]] = {}
    info_splits = []
    k = 0
    for split, lengths in splits:
        expected[split] = []
        for i, n in enumerate(lengths):
            path = d / f"{NAME}-{split}.{fmt}-{i:05d}-of-{len(lengths):05d}"
            blobs = []
            for _ in range(n):
                rec, blob = make_example(k)
                expected[split].append(rec)
                blobs.append(blob)
                k += 1
            if fmt == "array_record":
                w = ArrayRecordWriter(str(path), "group_size:1")
                for b in blobs:
                    w.write(b)
                w.close()
            else:
                write_tfrecord(blobs, path)
        info_splits.append(
            {
                "name": split,
                "shardLengths": [str(n) for n in lengths],
                "numBytes": "1234",
                "filepathTemplate": "{DATASET}-{SPLIT}.{FILEFORMAT}-{SHARD_X_OF_Y}",
            }
        )
    info = {
        "name": NAME,
        "version": "1.0.0",
        "description": "A tiny dataset shaped like TFDS output.",
        "fileFormat": fmt,
        "moduleName": f"{NAME}.{NAME}_dataset_builder",
        "splits": info_splits,
        "supervisedKeys": {"tuple": {"items": [{"featureKey": "image"}, {"featureKey": "label"}]}},
    }
    (d / "dataset_info.json").write_text(json.dumps(info, indent=2))
    (d / "features.json").write_text(json.dumps(FEATURES, indent=4))
    (d / "label.labels.txt").write_text("\n".join(str(i) for i in range(10)))
    return d, expected


def assert_same(a, b, where=""):
    if isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a) == sorted(b), f"{where}: {sorted(a)} {sorted(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (np.ndarray, np.generic)):
        b = np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape, f"{where}: {a.dtype}{a.shape} {b}"
        assert np.array_equal(a, b), where
    else:
        assert type(a) is type(b) and a == b, f"{where}: {a!r} != {b!r}"


def test_reads_a_split_with_features_decoded(tmp_path):
    d, expected = build_tfds_dir(tmp_path)
    src = tg.ArrayRecordSource(str(d / f"{NAME}-train.array_record*"), codec="tf_example")
    assert len(src) == 10 and src.num_shards == 2
    assert isinstance(src.codec, TFDSCodec)
    got = src.__getitems__(list(range(10)))
    for k, (want, rec) in enumerate(zip(expected["train"], got)):
        assert_same(want, rec, f"record {k}")
    assert src.schema["image"] == "uint8[8,8,1]" and src.schema["label"] == "int64"


def test_directory_of_several_splits_asks_for_one(tmp_path):
    d, _ = build_tfds_dir(tmp_path)
    with pytest.raises(ValueError, match="several TFDS splits") as e:
        tg.ArrayRecordSource(d, codec="tf_example")
    assert f"{NAME}-test.array_record*" in str(e.value)


def image_and_label(r):
    return {"x": r["image"], "y": r["label"]}


def test_single_split_directory_and_auto_codec(tmp_path):
    d, expected = build_tfds_dir(tmp_path, splits=(("train", [2, 3]),))
    for codec in ("tf_example", "auto"):
        src = tg.ArrayRecordSource(d, codec=codec)
        assert len(src) == 5
        assert_same(expected["train"][4], src[4])
    plain = tg.ArrayRecordSource(d, codec=TFExampleCodec())  # opt out of the feature spec
    assert plain[0]["label"].tolist() == [0] and isinstance(plain[0]["image"], list)
    loader = torch.utils.data.DataLoader(
        tg.Dataset(tg.ArrayRecordSource(d)).map(image_and_label),
        batch_size=5,
        num_workers=1,
        multiprocessing_context="spawn",
    )
    batch = next(iter(loader))
    assert batch["x"].shape == (5, 8, 8, 1) and batch["y"].tolist() == [0, 1, 2, 3, 4]


def test_convert_tfds_split_to_torchgrain(tmp_path):
    d, expected = build_tfds_dir(tmp_path)
    out = tmp_path / "out"
    m = tg.convert(str(d / f"{NAME}-test.array_record*"), out)
    assert m.num_records == 3
    back = tg.ArrayRecordSource(out)
    for want, rec in zip(expected["test"], back.__getitems__([0, 1, 2])):
        assert_same(want, rec)


def test_tfds_tfrecord_directory_converts_with_features(tmp_path):
    d, expected = build_tfds_dir(tmp_path, fmt="tfrecord", splits=(("validation", [2, 2]),))
    m = tg.convert(d, tmp_path / "out", num_shards=3, workers=2)
    assert [s.num_records for s in m.shards] == [1, 1, 2]
    back = tg.ArrayRecordSource(tmp_path / "out")
    for want, rec in zip(expected["validation"], back.__getitems__(list(range(4)))):
        assert_same(want, rec)


def test_legacy_features_layout_and_no_metadata(tmp_path):
    legacy = {
        "type": FC + "features_dict.FeaturesDict",
        "content": {
            "features": {
                "label": {"type": FC + "class_label_feature.ClassLabel", "content": {}},
                "xy": {"type": FC + "feature.Tensor", "content": {"shape": [2], "dtype": "int32"}},
            }
        },
    }
    rec = TFDSCodec(legacy).decode(encode_tf_example({"label": 3, "xy": [4, 5], "extra": b"e"}))
    assert rec["label"] == 3 and rec["xy"].dtype == np.int32 and rec["extra"] == [b"e"]
    d, _ = build_tfds_dir(tmp_path, splits=(("train", [2]),))
    plain = tmp_path / "plain"
    shutil.copytree(d, plain)
    os.unlink(plain / "features.json")
    os.unlink(plain / "dataset_info.json")
    assert tg.ArrayRecordSource(plain, codec="tf_example")[0]["label"].tolist() == [0]
