"""Vision-language models: the vision encoder and its projector as their own graph (vision.onnx:
pixel_values [images, 3, H, W] -> image_features [images, tokens, hidden]); the language model traced
as every other, its graph taking `image_features` in the place of the image token (export/trace.py);
and the family's processor read into the manifest's `vision` section, which the runtime follows
with no family code (sdk/vision.py).

Each family's record (export/families/) names its `VisionEncoder`: how its encoder is called, and
how its processor says what an image becomes (resize steps, rescale, normalization, the text
around its tokens); the code of each is in its family's module."""

from __future__ import annotations

import dataclasses
import io
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from edgeinfer.sdk.errors import ExportError
from edgeinfer.sdk.manifest import PICTURES_FORMAT_VERSION, VISION_FORMAT_VERSION, GraphSpec, Manifest

from .families import VISION_LANGUAGE, VisionEncoder, family
from .patches import images_only
from .trace import OPSET

VISION_FILE = "vision.onnx"


def load_processor(source_path: str):
    """The model's processor as transformers loads it; where its video processor needs torchvision
    (Qwen2.5-VL's), the same processor class built from its image processor and tokenizer alone."""
    from transformers import AutoConfig, AutoImageProcessor, AutoProcessor, AutoTokenizer
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    try:
        return AutoProcessor.from_pretrained(source_path)
    except ImportError as needs:
        if "Torchvision" not in str(needs):
            raise
    import transformers

    model_type = AutoConfig.from_pretrained(source_path).model_type
    processor_class = getattr(transformers, PROCESSOR_MAPPING_NAMES[model_type])
    tokenizer = AutoTokenizer.from_pretrained(source_path)
    parts = {"image_processor": AutoImageProcessor.from_pretrained(source_path), "tokenizer": tokenizer, "video_processor": None}
    saved, _ = processor_class.get_processor_dict(source_path)  # the processor's own settings (SmolVLM's image_seq_len)
    saved.setdefault("chat_template", tokenizer.chat_template)
    with images_only():
        return processor_class.from_args_and_dict([parts[name] for name in processor_class.get_attributes()], saved)


def is_vision(config) -> bool:
    return config.model_type in VISION_LANGUAGE


def vision_section(model, processor, folder: Path) -> dict:
    """The vision graph traced into `folder`, and the manifest's `vision` section."""
    encoder = family(model.config.model_type).vision
    described = encoder.describe(processor)
    graph = export_vision_graph(model, encoder, folder, _trace_shape(model, described))
    text = model.config.get_text_config()
    return {
        "graph": {"file": graph.file, "inputs": graph.inputs, "outputs": graph.outputs},
        "image_token_id": int(model.config.image_token_id),
        "hidden_size": int(text.hidden_size),
        **described,
    }


def _trace_shape(model, described: dict) -> tuple[int, ...]:
    """The pixels to trace with: two squares of the size the encoder takes; or, where a picture
    keeps its own size (`grid`), one picture of a window and a part high, two and a part wide."""
    if "grid" in described:
        grid = described["grid"]
        window = getattr(model.config.vision_config, "window_size", 2 * grid)
        return (1, 3, window + grid, 2 * window + grid)
    side = described["tiles"]["size"] if "tiles" in described else described["steps"][-1]["height"]
    return (2, 3, side, side)


def export_vision_graph(model, encoder: VisionEncoder, folder: Path, shape: tuple[int, ...]) -> GraphSpec:
    import torch

    class Encoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, pixel_values):
            return encoder.encode(self.model, pixel_values)

    pixels = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    sized = shape[0] == 1  # one picture of any size a pass, its tokens out
    axes = (
        {"pixel_values": {2: "height", 3: "width"}, "image_features": {0: "image_tokens"}}
        if sized
        else {
            "pixel_values": {0: "images"},
            "image_features": {0: "images"},
        }
    )
    path = folder / VISION_FILE
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            Encoder().eval(),
            (pixels,),
            str(path),
            dynamo=False,
            input_names=["pixel_values"],
            output_names=["image_features"],
            dynamic_axes=axes,
            opset_version=OPSET,
        )
    _weights_apart(path)
    return GraphSpec(file=VISION_FILE, inputs=["pixel_values"], outputs=["image_features"])


# Under --quantize the vision graph's MatMul weights go to int8 whatever the language model's bits:
# int4 is slower than int8 on the encoder and far further off (docs/benchmarks.md has the figures).
VISION_BITS, VISION_BLOCK = 8, 32


def quantize_vision(folder: Path) -> dict:
    """vision.onnx's MatMul weights in the export's work `folder` to int8 blocks (ONNX Runtime's
    MatMulNBits, int8 arithmetic on the CPU); what was done, for the manifest."""
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    path = folder / VISION_FILE
    graph = _gemms_as_matmuls(onnx.load(str(path)))
    quantizer = MatMulNBitsQuantizer(graph, bits=VISION_BITS, block_size=VISION_BLOCK, is_symmetric=False, accuracy_level=4)
    quantizer.process()
    graph = quantizer.model.model
    (folder / f"{VISION_FILE}.data").unlink()  # read whole above; the new weights take its place
    onnx.save(graph, str(path), save_as_external_data=True, location=f"{VISION_FILE}.data", size_threshold=1024)
    matmuls = sum(n.op_type == "MatMulNBits" for n in graph.graph.node)
    return {"method": f"int{VISION_BITS}", "block_size": VISION_BLOCK, "matmuls": matmuls}


def _gemms_as_matmuls(graph):
    """The graph with each Gemm of a constant weight (a linear layer on two-dimensional input, as
    Qwen's encoders trace) as a MatMul by its weight transposed and an Add of its bias, which the
    quantizer takes; alpha and beta 1, as torch.onnx writes them."""
    import onnx
    from onnx import helper, numpy_helper

    weights = {t.name: t for t in graph.graph.initializer}
    nodes = []
    for node in graph.graph.node:
        attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        plain = attributes.get("alpha", 1.0) == 1.0 and attributes.get("beta", 1.0) == 1.0 and not attributes.get("transA", 0)
        if node.op_type != "Gemm" or not plain or node.input[1] not in weights:
            nodes.append(node)
            continue
        weight = numpy_helper.to_array(weights[node.input[1]])
        name = f"{node.input[1]}_matmul"
        graph.graph.initializer.append(numpy_helper.from_array(weight.T.copy() if attributes.get("transB", 0) else weight, name))
        product = f"{node.output[0]}_product" if len(node.input) > 2 else node.output[0]
        nodes.append(helper.make_node("MatMul", [node.input[0], name], [product], name=f"{node.name}_matmul"))
        if len(node.input) > 2:
            nodes.append(helper.make_node("Add", [product, node.input[2]], [node.output[0]], name=f"{node.name}_bias"))
    del graph.graph.node[:]
    graph.graph.node.extend(nodes)
    used = {i for n in graph.graph.node for i in n.input}
    kept = [t for t in graph.graph.initializer if t.name in used]
    del graph.graph.initializer[:]
    graph.graph.initializer.extend(kept)
    onnx.checker.check_model(graph)
    return graph


def _weights_apart(path: Path) -> None:
    """The graph's weights in vision.onnx.data beside it, as the language model's are."""
    import onnx

    graph = onnx.load(str(path))
    onnx.save(graph, str(path), save_as_external_data=True, location=f"{path.name}.data", size_threshold=1024)


def with_vision(manifest: Manifest, model, source_path: str, folder: Path) -> Manifest:
    """`manifest` with its `vision` section, the vision graph traced into `folder`."""
    section = vision_section(model, load_processor(source_path), folder)
    # an older runtime would cut a picture between prefill passes, or not place its tokens: it must refuse such an export
    needs = PICTURES_FORMAT_VERSION if {"attention", "grid", "rotary"} & set(section) else VISION_FORMAT_VERSION
    return dataclasses.replace(manifest, vision=section, format_version=max(manifest.format_version, needs))


# The check: one image and a question, as transformers' processor and model see them, against the
# runtime's own pixels, prompt ids, logits and greedy tokens.

CHECK_QUESTION = "What is in this picture?"
CHECK_TOKENS = 4


@dataclass(frozen=True)
class VisionReference:
    text: str  # the prompt as the chat template writes it, one image marker in it
    image: bytes  # the check image, as PNG
    ids: list[int]  # the processor's prompt ids
    pixels: np.ndarray  # the processor's pixel values
    logits: np.ndarray  # at the prompt's last position
    greedy: list[int]
    layout: Callable | None = None  # the runtime's pixels laid out as `pixels` are (VisionEncoder.layout)


def check_image() -> bytes:
    """A fixed picture (a gradient with a bright square) of a shape no model takes as it is, as PNG."""
    from PIL import Image

    y, x = np.mgrid[0:45, 0:80]
    pixels = np.stack([x * 3, y * 5, (x + y) * 2], axis=-1).astype(np.uint8)
    pixels[10:25, 30:50] = (250, 240, 20)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def vision_reference(model, source_path: str) -> VisionReference:
    """transformers' side of the check, computed while the model is loaded."""
    import torch
    from PIL import Image

    processor = load_processor(source_path)
    image = check_image()
    text = _check_prompt(processor)
    inputs = processor(text=text, images=[Image.open(io.BytesIO(image)).convert("RGB")], return_tensors="pt")
    greedy, past, step = [], None, dict(inputs)
    try:
        with torch.no_grad():
            for n in range(CHECK_TOKENS):
                out = model(**step, cache=past, use_cache=True)
                if n == 0:
                    logits = out.logits[0, -1].float().numpy().copy()
                greedy.append(int(out.logits[0, -1].argmax()))
                past, step = out.cache, {"input_ids": torch.tensor([[greedy[-1]]])}
    finally:
        # Qwen's models keep the prompt's position shift for the next call, which would shift the
        # decode positions of the text-only references computed after this one
        if hasattr(model.model, "rope_deltas"):
            model.model.rope_deltas = None
    encoder = family(model.config.model_type).vision
    layout = encoder.layout(processor) if encoder.layout else None
    pixels = inputs["pixel_values"].float().numpy()
    return VisionReference(text, image, inputs["input_ids"][0].tolist(), pixels, logits, greedy, layout)


def _check_prompt(processor) -> str:
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": CHECK_QUESTION}]}]
    if getattr(processor, "chat_template", None):
        from transformers.processing_utils import ProcessorMixin

        # SmolVLMProcessor's own apply_chat_template reads its video processor's frame rate, which a
        # processor built for images alone has not: the base class renders the same text for images
        return ProcessorMixin.apply_chat_template(processor, messages, add_generation_prompt=True)
    return processor.image_token + CHECK_QUESTION


def check_vision(reference: VisionReference, folder: Path, gate: bool = True) -> dict:
    """The runtime's pixels, prompt ids, logits and greedy tokens for the reference's image and
    prompt, against transformers'; ExportError where the ids differ, or (`gate`) the logits are off."""
    from edgeinfer.sdk.engine import Engine
    from edgeinfer.sdk.vision import expand, name_pictures, picture

    from .validate import RELATIVE_TOLERANCE

    engine = Engine.load(folder, provider="cpu", prefix_cache=0)
    vision = engine.manifest.vision
    item = picture(reference.image, vision)
    ids = engine.tokenizer.encode(expand(reference.text, vision, [item]), False)
    engine.runner.see([item])
    logits, greedy = _runtime_greedy(engine, name_pictures(ids, vision, [item]))
    result = {
        "max_abs_diff_pixels": _pixels_difference(item.pixels, reference),
        "ids_equal": ids == reference.ids,
        "max_abs_diff_logits": float(np.abs(logits - reference.logits).max()),
        "tokens_equal": greedy == reference.greedy,
        "tolerance": RELATIVE_TOLERANCE[engine.manifest.dtype] * max(1.0, float(np.abs(reference.logits).max())),
    }
    if not result["ids_equal"] or (gate and result["max_abs_diff_logits"] > result["tolerance"]):
        raise ExportError(
            f"with an image the export differs from transformers (prompt ids {'equal' if result['ids_equal'] else 'differ'}, "
            f"logits by {result['max_abs_diff_logits']:.3g}, tolerance {result['tolerance']:.3g}): the export is not valid"
        )
    return result


def _pixels_difference(pixels: np.ndarray, reference: VisionReference) -> float:
    ours = reference.layout(pixels) if reference.layout else pixels
    if ours.size != reference.pixels.size:
        return float("inf")  # another size: the prompt ids differ too, which the check reports
    return float(np.abs(ours - reference.pixels.reshape(ours.shape)).max())


def _runtime_greedy(engine, ids: list[int]) -> tuple[np.ndarray, list[int]]:
    runner = engine.runner
    batch = runner.new_batch()
    logits = runner.prefill(batch, [ids]).numpy()[0, -1].astype(np.float32)
    first, greedy = logits, [int(logits.argmax())]
    while len(greedy) < CHECK_TOKENS:
        logits = runner.decode(batch, [greedy[-1]]).numpy()[0, -1]
        greedy.append(int(logits.argmax()))
    return first, greedy
