"""The manifest's preprocessing section: signed and strict (unknown, missing or tampered keys
refused), checked against the graphs it feeds and the tokenizers it names; and the
preprocessing itself on single images and token batches, against numpy written out here."""

from __future__ import annotations

import io
import json
import sys

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fctkit.errors import BundleFormatError, DependencyError, HashMismatchError, SignatureError
from fctkit.export.bundle_builder import ArtifactSource, build_bundle
from fctkit.protos.bundle import MANIFEST_FILE, SIGNATURE_FILE, verify_bundle
from fctkit.protos.preprocessing import ItemProblem, Preprocessor, decode_image, pad_tokens, pool
from fctkit.protos.preprocessing_spec import ImagePreprocessing, Preprocessing, TextPreprocessing

KEY = Ed25519PrivateKey.from_private_bytes(bytes(range(32)))
GATE = {"cases": {}, "ecc": {}}
IMAGE = ImagePreprocessing(input="pixels", crop=(4, 4), mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))
IMAGE_SECTION = Preprocessing((("embed", IMAGE),))


def linear_graph(path, input_name: str, shape: list, *, dtype: str = "float"):
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    elem = TensorProto.FLOAT if dtype == "float" else TensorProto.INT64
    flat = int(np.prod([d for d in shape[1:] if isinstance(d, int)]))
    nodes = [
        helper.make_node("Flatten", [input_name], ["flat"]),
        helper.make_node("Cast", ["flat"], ["flatf"], to=TensorProto.FLOAT),
        helper.make_node("MatMul", ["flatf", "W"], ["embedding"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(input_name, elem, shape)],
        [helper.make_tensor_value_info("embedding", TensorProto.FLOAT, ["batch", 5])],
        initializer=[numpy_helper.from_array(np.ones((flat, 5), np.float32), "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def image_bundle(tmp_path, name="b", *, preprocessing=IMAGE_SECTION, graph=None, extra=()):
    graph = graph or linear_graph(tmp_path / f"{name}.onnx", "pixels", ["batch", 3, 4, 4])
    return build_bundle(
        tmp_path / name,
        version=1,
        parents=(),
        mode="forward",
        distance="cosine",
        normalize=True,
        artifacts=[ArtifactSource(graph, "embed"), *extra],
        gate=GATE,
        private_key=KEY,
        preprocessing=preprocessing,
    )


def resigned(bundle, edit) -> None:
    """Edit the manifest's JSON, write it canonically and sign it again with the publisher key."""
    manifest = json.loads((bundle.root / MANIFEST_FILE).read_text())
    edit(manifest)
    data = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode("ascii")
    (bundle.root / MANIFEST_FILE).write_bytes(data)
    (bundle.root / SIGNATURE_FILE).write_bytes(KEY.sign(data))


def test_the_section_is_signed_strict_and_versioned(tmp_path):
    bundle = image_bundle(tmp_path)
    assert verify_bundle(bundle.root, KEY.public_key()).manifest.preprocessing.of("embed") == IMAGE
    text = (bundle.root / MANIFEST_FILE).read_text()
    (bundle.root / MANIFEST_FILE).write_text(text.replace('"resize":0', '"resize":8'))
    with pytest.raises(SignatureError):
        verify_bundle(bundle.root, KEY.public_key())
    cases = [
        (lambda m: m["preprocessing"]["embed"].update(gamma=2.2), "unknown key\\(s\\) gamma"),
        (lambda m: m["preprocessing"]["embed"].pop("layout"), "missing key\\(s\\) layout"),
        (lambda m: m["preprocessing"].update(format="fctkit-preprocessing/2"), "is not supported"),
        (lambda m: m["preprocessing"].update(query_map={}), "unknown key\\(s\\) query_map"),
        (lambda m: m["preprocessing"]["embed"].update(mode="CMYK"), "'CMYK' is not one of RGB, BGR, L"),
        (lambda m: m["preprocessing"]["embed"].update(std=[1.0, 0.0, 1.0]), "must be > 0"),
        (lambda m: m["preprocessing"]["embed"].update(crop=[8, 8]), "makes float images of \\(3, 8, 8\\)"),
        (lambda m: m["preprocessing"]["embed"].update(input="image"), "feeds exactly one, 'image'"),
    ]
    for number, (edit, message) in enumerate(cases):
        broken = image_bundle(tmp_path, f"case{number}")
        resigned(broken, edit)
        with pytest.raises(BundleFormatError, match=message):
            verify_bundle(broken.root, KEY.public_key())


def test_graphs_and_tokenizers_must_match_the_declarations(tmp_path):
    tokens = linear_graph(tmp_path / "tokens.onnx", "input_ids", ["batch", "tokens"], dtype="int64")
    with pytest.raises(BundleFormatError, match="dynamic axes after the batch"):
        image_bundle(tmp_path, "dynamic", preprocessing=None, graph=tokens)
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text(word_level_json())
    text = TextPreprocessing(output="embedding", attention_mask=None, pooling="none")
    with pytest.raises(BundleFormatError, match="names tokenizer 'tokenizer', which is no tokenizer artifact"):
        image_bundle(tmp_path, "untokenized", preprocessing=Preprocessing((("embed", text),)), graph=tokens)
    spare = ArtifactSource(tokenizer, "tokenizer", name="spare")
    with pytest.raises(BundleFormatError, match="\\['spare'\\] are not named by any declaration"):
        image_bundle(tmp_path, "spare", extra=(spare,))
    bundle = image_bundle(
        tmp_path,
        "text",
        preprocessing=Preprocessing((("embed", text),)),
        graph=tokens,
        extra=(ArtifactSource(tokenizer, "tokenizer"),),
    )
    assert [(a.role, a.file, a.inputs) for a in bundle.manifest.artifacts][1] == ("tokenizer", "tokenizer.json", ())
    (bundle.root / "tokenizer.json").write_text(word_level_json().replace('"b":5', '"b":6'))
    with pytest.raises(HashMismatchError, match="tokenizer"):
        verify_bundle(bundle.root, KEY.public_key())


def word_level_json() -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"[PAD]": 0, "[UNK]": 1, "a": 4, "b": 5}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return tokenizer.to_str()


def png(pixels: np.ndarray, fmt: str = "PNG") -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format=fmt)
    return out.getvalue()


def test_an_image_is_converted_resized_cropped_and_laid_out_as_declared():
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, size=(6, 8, 3), dtype=np.uint8)
    grey = ImagePreprocessing(input="x", crop=(4, 6), mode="L", layout="NHWC", scale=2.0, mean=(10.0,), std=(4.0,))
    from PIL import Image

    luminance = np.asarray(Image.fromarray(pixels).convert("L"), np.float32)[1:5, 1:7, None]
    np.testing.assert_allclose(decode_image(png(pixels), grey), (luminance * 2 - 10) / 4)
    bgr = ImagePreprocessing(input="x", crop=(6, 8), mode="BGR", mean=(0.0,) * 3, std=(1.0,) * 3)
    np.testing.assert_allclose(decode_image(png(pixels), bgr), pixels[..., ::-1].transpose(2, 0, 1) / 255, rtol=1e-6)
    resized = decode_image(
        png(pixels), ImagePreprocessing(input="x", crop=(3, 4), resize=3, mean=(0.0,) * 3, std=(1.0,) * 3)
    )
    assert resized.shape == (3, 3, 4)  # 6x8 -> shorter side 3: 3x4, then the crop
    with pytest.raises(ItemProblem, match="smaller than the 8x8 crop"):
        decode_image(png(pixels), ImagePreprocessing(input="x", crop=(8, 8), mean=(0.0,) * 3, std=(1.0,) * 3))
    with pytest.raises(ItemProblem, match="is a GIF image"):
        decode_image(png(pixels, "GIF"), grey)
    with pytest.raises(ItemProblem, match="is empty"):
        decode_image(b"", grey)


def test_mean_pooling_ignores_padding_so_a_text_embeds_alike_in_any_batch():
    declaration = TextPreprocessing(output="h", max_length=6, pooling="mean", normalize=False)
    short, long = np.array([[2, 7, 3], [0, 0, 0]]), np.array([[2, 7, 8, 9, 3], [0, 0, 0, 0, 0]])
    ids, mask, _types = pad_tokens([short, long], declaration)
    assert ids.tolist() == [[2, 7, 3, 0, 0], [2, 7, 8, 9, 3]] and mask.sum(axis=1).tolist() == [3, 5]
    hidden = np.random.default_rng(1).normal(size=(2, 5, 4)).astype(np.float32)
    np.testing.assert_allclose(pool(hidden, mask, declaration)[0], hidden[0, :3].mean(axis=0), rtol=1e-6)
    fixed = pad_tokens([short], TextPreprocessing(output="h", max_length=6, padding="max_length"))[0]
    assert fixed.shape == (1, 6)
    cls = pool(hidden, mask, TextPreprocessing(output="h", pooling="cls"))
    np.testing.assert_allclose(cls, hidden[:, 0] / np.linalg.norm(hidden[:, 0], axis=1, keepdims=True), rtol=1e-6)


def test_a_missing_extra_is_named(tmp_path, monkeypatch):
    tokens = linear_graph(tmp_path / "tokens.onnx", "input_ids", ["batch", "tokens"], dtype="int64")
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text(word_level_json())
    text = TextPreprocessing(output="embedding", attention_mask=None, pooling="none")
    bundle = image_bundle(
        tmp_path,
        "text",
        preprocessing=Preprocessing((("embed", text),)),
        graph=tokens,
        extra=(ArtifactSource(tokenizer, "tokenizer"),),
    )
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(DependencyError, match="fctkit\\[text\\]"):
        Preprocessor(text, bundle.manifest.artifact("embed"), tokenizer.read_bytes())
    monkeypatch.setitem(sys.modules, "PIL.Image", None)
    with pytest.raises(DependencyError, match="fctkit\\[images\\]"):
        decode_image(b"\x89PNG", IMAGE)
