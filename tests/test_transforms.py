import io
import os
import pickle
import random
import subprocess
import sys

os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")  # no online version check

import albumentations as A
import cv2
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from PIL import Image
from torch.utils.data import DataLoader

import torchgrain as tg
from torchgrain.transforms import DecodeImage, _GeneratorRandom

# Module level so DataLoader workers can unpickle them under any start method.
PIPELINE = A.Compose(
    [
        A.RandomResizedCrop((24, 24), scale=(0.3, 1.0)),
        A.HorizontalFlip(),
        A.RandomBrightnessContrast(p=0.8),
    ]
)
# Only exact (interpolation-free) geometry, so the mask must follow the image exactly.
GEOMETRY = A.Compose([A.RandomCrop(20, 20), A.HorizontalFlip(), A.RandomRotate90(), A.Transpose()])


def drop_id(rec):
    return {k: v for k, v in rec.items() if k != "id"}


@pytest.fixture(scope="module")
def image_dataset(tmp_path_factory):
    rng = np.random.default_rng(1)
    recs = [
        {
            "image": rng.integers(0, 255, (32, 32, 3), dtype=np.uint8),
            "seg": rng.integers(0, 5, (32, 32), dtype=np.uint8),
            "label": i % 3,
            "id": f"r{i}",
        }
        for i in range(40)
    ]
    d = tmp_path_factory.mktemp("images") / "ds"
    tg.write_array_record(recs, d, num_shards=3)
    return str(d), recs


def augmented(d, *, seed=0):
    ds = tg.Dataset(tg.ArrayRecordSource(d)).map(drop_id)
    return ds.random_map(tg.Albumentations(PIPELINE, targets={"mask": "seg"}), seed=seed)


def batches(ds, order, *, num_workers=0, epoch=0, batch_size=4):
    ds.set_epoch(epoch)
    loader = DataLoader(ds, batch_size=batch_size, sampler=order, num_workers=num_workers)
    return [{k: v.clone() for k, v in b.items()} for b in loader]


def assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            torch.testing.assert_close(x[k], y[k], rtol=0, atol=0)


# ----------------------------------------------------------------- Albumentations
def test_albumentations_same_across_workers_resume_and_differs_across_epochs(image_dataset):
    d, _ = image_dataset
    order = np.random.default_rng(0).permutation(40).tolist()
    ref = batches(augmented(d), order, num_workers=0)
    assert ref[0]["image"].shape == (4, 24, 24, 3)
    assert_same(ref, batches(augmented(d), order, num_workers=2))
    # Resume: a fresh Dataset and loader over the rest of the epoch's order.
    assert_same(ref[6:], batches(augmented(d), order[24:], num_workers=2))
    # Another epoch (or seed) augments differently.
    other_epoch = batches(augmented(d), order, epoch=1)
    other_seed = batches(augmented(d, seed=1), order)
    for other in (other_epoch, other_seed):
        diff = [not torch.equal(x["image"], y["image"]) for x, y in zip(ref, other)]
        assert all(diff)


def test_albumentations_leaves_global_random_state_and_the_given_pipeline_alone(image_dataset):
    d, _ = image_dataset
    random.seed(5)
    np.random.seed(5)
    py_state, np_state = random.getstate(), np.random.get_state()[1].copy()
    user_rng = PIPELINE.random_generator
    ds = augmented(d)
    _ = [ds[i] for i in range(10)]
    assert random.getstate() == py_state
    assert np.array_equal(np.random.get_state()[1], np_state)
    assert PIPELINE.random_generator is user_rng  # the adapter works on its own copy


def test_albumentations_mask_follows_image(image_dataset):
    d, recs = image_dataset
    ds = tg.Dataset(tg.ArrayRecordSource(d)).map(lambda r: {**r, "seg": r["image"][:, :, 1]})
    ds = ds.random_map(tg.Albumentations(GEOMETRY, targets={"mask": "seg"}), seed=3)
    moved = 0
    for i in range(len(recs)):
        r = ds[i]
        np.testing.assert_array_equal(r["seg"], r["image"][:, :, 1])
        assert r["label"] == recs[i]["label"] and r["id"] == recs[i]["id"]
        moved += not np.array_equal(r["image"], recs[i]["image"][:20, :20])
    assert moved > len(recs) // 2  # crops, flips and rotations did happen


def test_albumentations_bboxes_and_labels_targets():
    pipeline = A.Compose(
        [A.HorizontalFlip(p=1.0)],
        bbox_params=A.BboxParams(format="pascal_voc", label_fields=["class_labels"]),
    )
    aug = tg.Albumentations(
        pipeline, image_key="img", targets={"bboxes": "boxes", "class_labels": "cls"}
    )
    rec = {"img": np.zeros((10, 20, 3), np.uint8), "boxes": [[2, 1, 6, 5]], "cls": [7]}
    out = aug(rec, tg.record_rng(0, 0, 0))
    np.testing.assert_allclose(np.asarray(out["boxes"]), [[14, 1, 18, 5]])
    assert list(out["cls"]) == [7]


def test_albumentations_accepts_a_list_and_reports_bad_input():
    aug = tg.Albumentations([A.HorizontalFlip(p=1.0)])
    img = np.arange(6, dtype=np.uint8).reshape(1, 6, 1).repeat(3, axis=2)
    out = aug({"image": img}, tg.record_rng(0, 0, 0))["image"]
    np.testing.assert_array_equal(out[0, :, 0], img[0, ::-1, 0])
    with pytest.raises(KeyError, match=r"'picture'.*keys: \['image'\]"):
        tg.Albumentations(PIPELINE, image_key="picture")({"image": img}, tg.record_rng(0, 0, 0))
    with pytest.raises(TypeError, match="RandomImageTransform"):
        tg.Albumentations(lambda image: image)
    with pytest.raises(ValueError, match="image_key"):
        tg.Albumentations(PIPELINE, targets={"image": "x"})


def test_albumentations_pickles_and_stays_reproducible():
    aug = tg.Albumentations(PIPELINE)
    img = np.random.default_rng(0).integers(0, 255, (32, 32, 3), dtype=np.uint8)
    a = aug({"image": img}, tg.record_rng(0, 0, 9))["image"]
    b = pickle.loads(pickle.dumps(aug))({"image": img}, tg.record_rng(0, 0, 9))["image"]
    np.testing.assert_array_equal(a, b)


def test_generator_random_draws_only_from_the_generator():
    def draws(seed):
        r = _GeneratorRandom()
        r.gen = np.random.default_rng(seed)
        x = list(range(10))
        r.shuffle(x)
        return (
            r.random(),
            r.uniform(2, 3),
            r.randint(0, 9),
            r.choice("abc"),
            x,
            r.sample(range(100), 3),
            r.gauss(0, 1),
            r.getrandbits(70),
            r.getrandbits(0),
        )

    before = random.getstate()
    assert draws(1) == draws(1) and draws(1) != draws(2)
    assert random.getstate() == before
    assert 0 <= draws(3)[7] < 1 << 70
    with pytest.raises(ValueError):
        _GeneratorRandom().getrandbits(-1)


def test_random_image_transform_with_a_plain_function():
    def shift(image, rng):
        return image + rng.integers(0, 10)

    ds = tg.Dataset([{"image": np.zeros((2, 2, 1), np.int64), "k": 1}] * 4)
    ds = ds.random_map(tg.RandomImageTransform(shift), seed=0)
    assert [int(ds[i]["image"][0, 0, 0]) for i in range(4)] == [
        int(ds[i]["image"][0, 0, 0]) for i in range(4)
    ]
    assert ds[0]["k"] == 1
    with pytest.raises(KeyError, match="RandomImageTransform"):
        tg.RandomImageTransform(shift, key="x")({"image": 1}, np.random.default_rng(0))


def test_missing_albumentations_gives_install_hint():
    code = (
        "import sys; sys.modules['albumentations'] = None; sys.modules['cv2'] = None\n"
        "import torchgrain as tg\n"
        "for make in (lambda: tg.Albumentations([]), lambda: tg.decode_image(backend='cv2')):\n"
        "    try:\n"
        "        make()\n"
        "    except ImportError as e:\n"
        "        print(e)\n"
        "print(tg.decode_image().backend)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    ).stdout.splitlines()
    assert "torchgrain.Albumentations needs the optional package 'albumentations'" in out[0]
    assert "pip install 'torchgrain[augment]'" in out[0]
    assert "opencv-python-headless" in out[1] and "torchgrain[augment]" in out[1]
    assert out[2] == "pillow"  # auto falls back to Pillow without OpenCV


# ------------------------------------------------------------------- decode_image
@pytest.fixture(scope="module")
def picture():
    yy, xx = np.mgrid[0:48, 0:64]
    return np.stack([xx * 4, yy * 5, (xx + yy) * 2], -1).astype(np.uint8)


def encode(img, fmt, **kw):
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, fmt, **kw)
    return buf.getvalue()


@pytest.mark.parametrize("backend", ["cv2", "pillow"])
def test_decode_png_exact_and_jpeg_close(picture, backend):
    png = cv2.imencode(".png", picture[:, :, ::-1])[1].tobytes()  # cv2 writes BGR
    jpg = encode(picture, "JPEG", quality=95)
    dec = tg.decode_image("img", backend=backend)
    ds = tg.Dataset([{"img": png, "y": 1}, {"img": jpg, "y": 2}]).map(dec)
    r0, r1 = ds[0], ds[1]
    np.testing.assert_array_equal(r0["img"], picture)
    assert r0["img"].dtype == np.uint8 and r0["y"] == 1
    assert r1["img"].shape == picture.shape
    assert np.abs(r1["img"].astype(int) - picture).mean() < 3
    bgr = tg.decode_image("img", mode="BGR", backend=backend)({"img": png})["img"]
    np.testing.assert_array_equal(bgr, picture[:, :, ::-1])
    gray = tg.decode_image("img", mode="L", backend=backend)({"img": np.frombuffer(png, np.uint8)})
    assert gray["img"].shape == (48, 64, 1)
    expected = cv2.cvtColor(picture, cv2.COLOR_RGB2GRAY)
    assert np.abs(gray["img"][:, :, 0].astype(int) - expected).max() <= 1


def test_decode_backends_agree_and_apply_exif_orientation(picture):
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise on display
    jpg = encode(picture, "JPEG", quality=95, exif=exif)
    a = tg.decode_image(backend="cv2").decode(jpg)
    b = tg.decode_image(backend="pillow").decode(jpg)
    assert a.shape == b.shape == (64, 48, 3)
    assert np.abs(a.astype(int) - b).max() <= 8  # both libjpeg, IDCT details may differ


@pytest.mark.parametrize("backend", ["cv2", "pillow"])
def test_decode_bad_bytes_raise_record_decode_error(picture, backend):
    dec = DecodeImage("image", backend=backend)
    jpg = encode(picture, "JPEG")
    for bad in (b"", b"definitely not an image", jpg[: len(jpg) // 2]):
        with pytest.raises(tg.RecordDecodeError, match=f"key 'image' holds {len(bad)} bytes"):
            dec({"image": bad})
    with pytest.raises(TypeError, match="expected bytes"):
        dec({"image": "a string"})
    with pytest.raises(TypeError, match="already decoded"):
        dec({"image": picture})
    with pytest.raises(KeyError, match="decode_image"):
        dec({"img": jpg})
    with pytest.raises(ValueError, match="mode"):
        tg.decode_image(mode="CMYK")
    with pytest.raises(ValueError, match="backend"):
        tg.decode_image(backend="turbo")


# ---------------------------------------------------------------------- map_batch
class CountingCenter:
    """Subtract a constant from every image, vectorised over the batch; counts calls."""

    def __init__(self):
        self.sizes = []

    def __call__(self, records):
        self.sizes.append(len(records))
        x = tg.stack_key(records, "image").astype(np.float32)
        return tg.unstack_key(records, "image", x - 100.0)


def center_one(rec):
    return {**rec, "image": rec["image"].astype(np.float32) - 100.0}


def noise(rec, rng):
    return {**rec, "noise": rng.integers(0, 1 << 30)}


def test_map_batch_called_once_per_batch_with_per_record_results(small_dataset):
    d, _ = small_dataset
    base = tg.Dataset(tg.ArrayRecordSource(d)).map(drop_id)
    counter = CountingCenter()
    batched = base.random_map(noise, seed=1).map_batch(counter).random_map(noise, seed=2)
    per_record = base.random_map(noise, seed=1).map(center_one).random_map(noise, seed=2)
    order = np.random.default_rng(0).permutation(100).tolist()
    got = batches(batched, order, batch_size=8)
    assert counter.sizes == [8] * 12 + [4]
    assert_same(got, batches(per_record, order, batch_size=8))
    assert_same(got, batches(batched, order, batch_size=8, num_workers=2))
    # __getitem__ runs the batch function on a one-element list
    r = batched[order[0]]
    assert counter.sizes[-1] == 1
    torch.testing.assert_close(torch.as_tensor(r["image"]), got[0]["image"][0])
    assert r["noise"] == got[0]["noise"][0]
    assert "map_batch(CountingCenter)" in repr(batched)


def test_map_batch_must_return_one_record_per_input():
    ds = tg.Dataset([{"x": 1}] * 4)
    with pytest.raises(TypeError, match=r"must return a list of 3 records.*got a list of 1"):
        ds.map_batch(lambda rs: rs[:1]).__getitems__([0, 1, 2])
    with pytest.raises(TypeError, match="got dict"):
        ds.map_batch(lambda rs: {"x": [r["x"] for r in rs]})[0]
    with pytest.raises(TypeError, match="callable"):
        ds.map_batch(3)


def test_stack_and_unstack_key():
    recs = [{"x": np.full(2, i), "id": i} for i in range(3)]
    assert tg.stack_key(recs, "x").shape == (3, 2)
    with pytest.raises(KeyError, match="stack_key"):
        tg.stack_key([{"x": 1}, {"y": 2}], "x")
    with pytest.raises(ValueError, match="2 values for 3 records"):
        tg.unstack_key(recs, "x", [1, 2])


# -------------------------------------------------------------------- key helpers
def test_select_and_rename_keys():
    rec = {"a": 1, "b": 2, "c": 3}
    assert tg.SelectKeys("c", "a")(rec) == {"c": 3, "a": 1}
    assert list(tg.SelectKeys("c", "a")(rec)) == ["c", "a"]
    with pytest.raises(KeyError, match="SelectKeys: record has no key 'z'"):
        tg.SelectKeys("z")(rec)
    assert tg.RenameKeys({"a": "x", "b": "a"})(rec) == {"x": 1, "a": 2, "c": 3}
    with pytest.raises(ValueError, match="overwrite"):
        tg.RenameKeys({"a": "b"})(rec)
    with pytest.raises(KeyError, match="RenameKeys"):
        tg.RenameKeys({"q": "r"})(rec)
    with pytest.raises(ValueError, match="two keys"):
        tg.RenameKeys({"a": "x", "b": "x"})


def test_label_to_index():
    f = tg.LabelToIndex("label", ["cat", "dog", "eel"])
    assert f({"label": "eel", "k": 0}) == {"label": 2, "k": 0}
    assert f({"label": b"dog"})["label"] == 1
    assert f({"label": np.str_("cat")})["label"] == 0
    with pytest.raises(KeyError, match="'cow' under key 'label' is not in the vocabulary of 3"):
        f({"label": "cow"})
    assert tg.LabelToIndex("label", {"cat": 5}, unknown=-1)({"label": "cow"})["label"] == -1
    with pytest.raises(ValueError, match="repeated"):
        tg.LabelToIndex("label", ["a", "b", "a"])
    with pytest.raises(TypeError):
        tg.LabelToIndex("label", "abc")


def test_to_tensor():
    writable = np.arange(24, dtype=np.float32).reshape(2, 4, 3)
    frozen = np.frombuffer(np.arange(4, dtype=np.int64).tobytes(), np.int64)
    rec = {"image": writable, "ids": frozen, "flip": writable[:, ::-1], "id": "a", "y": 3}
    out = tg.ToTensor(channels_first=["image"])(rec)
    assert out["image"].shape == (3, 2, 4)
    assert out["image"].data_ptr() == writable.ctypes.data  # zero copy
    torch.testing.assert_close(out["image"].permute(1, 2, 0), torch.from_numpy(writable))
    assert out["ids"].tolist() == [0, 1, 2, 3] and out["flip"].shape == (2, 4, 3)
    torch.testing.assert_close(out["flip"], torch.from_numpy(writable[:, ::-1].copy()))
    assert out["id"] == "a" and out["y"] == 3  # untouched: not arrays
    only = tg.ToTensor(["y", "ids"], dtype=torch.float64)(rec)
    assert only["y"].dtype == torch.float64 and only["ids"].dtype == torch.float64
    assert isinstance(only["image"], np.ndarray)
    assert tg.ToTensor(channels_first=True)(rec)["flip"].shape == (3, 2, 4)
    with pytest.raises(TypeError, match="'id'"):
        tg.ToTensor(["id"])(rec)
    with pytest.raises(KeyError, match="ToTensor"):
        tg.ToTensor(["nope"])(rec)


def test_helpers_pickle():
    helpers = [
        tg.SelectKeys("a"),
        tg.RenameKeys({"a": "b"}),
        tg.LabelToIndex("a", ["x"]),
        tg.ToTensor(channels_first=["a"]),
        tg.MaskTokens("a", mask_id=1, vocab_size=10),
        tg.decode_image(),
        tg.RandomImageTransform(noise),
        tg.Albumentations(PIPELINE),
    ]
    for h in helpers:
        assert type(pickle.loads(pickle.dumps(h))) is type(h)


# ---------------------------------------------------------------------- MaskTokens
def test_mask_tokens_reproducible_and_bert_like():
    ids = np.random.default_rng(0).integers(5, 1000, 20_000).astype(np.int32)
    ids[::10] = 0  # padding, never masked
    mask = tg.MaskTokens("ids", mask_id=3, vocab_size=1000, special_ids=[0, 1])
    ds = tg.Dataset([{"ids": ids}] * 3).random_map(mask, seed=4)
    a, b, c = ds[0], ds[0], ds[1]
    np.testing.assert_array_equal(a["ids"], b["ids"])
    np.testing.assert_array_equal(a["labels"], b["labels"])
    assert not np.array_equal(a["labels"], c["labels"])
    ds.set_epoch(1)
    assert not np.array_equal(ds[0]["labels"], a["labels"])
    chosen = a["labels"] != -100
    assert a["ids"].dtype == np.int32 and a["labels"].dtype == np.int64
    assert not chosen[::10].any()
    assert 0.13 < chosen.mean() / 0.9 < 0.17
    np.testing.assert_array_equal(a["labels"][chosen], ids[chosen])
    np.testing.assert_array_equal(a["ids"][~chosen], ids[~chosen])
    masked = (a["ids"] == 3) & chosen
    assert 0.75 < masked.sum() / chosen.sum() < 0.85
    kept = (a["ids"] == ids) & chosen
    assert 0.07 < kept.sum() / chosen.sum() < 0.13


@given(
    ids=st.lists(st.integers(0, 50), min_size=0, max_size=60),
    p=st.floats(0, 1),
    seed=st.integers(0, 2**64 - 1),
)
def test_mask_tokens_properties(ids, p, seed):
    ids = np.asarray(ids, dtype=np.int64)
    out = tg.MaskTokens("t", mask_id=99, vocab_size=51, probability=p, special_ids=[0])(
        {"t": ids}, tg.record_rng(seed, 0, 0)
    )
    chosen = out["labels"] != -100
    assert out["t"].shape == ids.shape == out["labels"].shape
    assert not chosen[ids == 0].any()
    assert (out["t"][~chosen] == ids[~chosen]).all()
    assert (out["labels"][chosen] == ids[chosen]).all()
    assert ((out["t"][chosen] == 99) | (out["t"][chosen] <= 50)).all()


def test_mask_tokens_validates():
    with pytest.raises(ValueError, match="vocab_size"):
        tg.MaskTokens("t", mask_id=1)
    tg.MaskTokens("t", mask_id=1, random_replace_prob=0)  # no vocab needed
    with pytest.raises(ValueError, match="<= 1"):
        tg.MaskTokens("t", mask_id=1, vocab_size=5, mask_replace_prob=0.9, random_replace_prob=0.2)
    with pytest.raises(TypeError, match="int ids"):
        tg.MaskTokens("t", mask_id=1, vocab_size=5)({"t": np.zeros(3)}, tg.record_rng(0, 0, 0))
