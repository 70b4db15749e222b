#!/usr/bin/env python3
"""Deterministic test images for the orientation and layout models.

Uses only Pillow (>= 10.1, for the scalable built-in font returned by
ImageFont.load_default(size=N)) and numpy. No external font files.

Writes into the output directory (default: the directory of this script):
  text_0.png            white 640x480 page, black English text, upright
  text_90.png           same page, text rotated 90 deg clockwise   (640x480 -> 480x640)
  text_180.png          same page, text rotated 180 deg
  text_270.png          same page, text rotated 270 deg clockwise  (= 90 deg counter-clockwise)
  text_90.jpg           JPEG (quality 90) copy of text_90.png
  page.png              620x877 white document page: bold title, paragraphs,
                        a small table and a figure box with a caption

All PNGs are 8-bit RGB without alpha (the reference loaders treat RGBA specially).

Usage: python make_images.py [OUT_DIR]
"""
import os
import sys

import numpy as np
from PIL import Image, ImageDraw, ImageFont

BODY_TEXT = (
    "The quick brown fox jumps over the lazy dog. Rampart serves models over "
    "HTTP and gRPC with dynamic batching, so many small requests can share one "
    "forward pass. Every request is checked against the model signature before "
    "it is queued. The scheduler groups inputs of the same shape, waits a few "
    "milliseconds for more work, and then runs the whole batch at once. Results "
    "are split again and returned to each caller in the order they arrived. "
    "Metrics record queue time, compute time and batch sizes for every model."
)

PARA2 = (
    "Document layout analysis finds the regions of a page: titles, paragraphs "
    "of text, figures, tables and their captions. A detector predicts a box and "
    "a class for every region, and later stages read the text inside each box. "
    "Good layout results make reading order and table extraction much easier."
)

PARA3 = (
    "Text orientation classification decides whether a page image is upright or "
    "rotated by ninety, one hundred and eighty or two hundred and seventy degrees. "
    "Pages scanned the wrong way round are turned back before recognition starts, "
    "which keeps the error rate of the recogniser low on real office documents."
)


def font(size):
    return ImageFont.load_default(size=size)


def wrap(draw, text, fnt, max_w):
    """Greedy word wrap using the rendered width of each candidate line."""
    lines, cur = [], ""
    for word in text.split():
        cand = word if not cur else cur + " " + word
        if draw.textlength(cand, font=fnt) <= max_w:
            cur = cand
        else:
            lines.append(cur)
            cur = word
    if cur:
        lines.append(cur)
    return lines


def text_page(w=640, h=480, size=26, margin=24, spacing=1.35):
    img = Image.new("RGB", (w, h), (255, 255, 255))
    d = ImageDraw.Draw(img)
    fnt = font(size)
    text = (BODY_TEXT + " " + PARA2)
    lines = wrap(d, text, fnt, w - 2 * margin)
    y = margin
    step = int(round(size * spacing))
    for line in lines:
        if y + size > h - margin:
            break
        d.text((margin, y), line, fill=(0, 0, 0), font=fnt)
        y += step
    return img


def rotate_cw(img, deg):
    """Rotate the image (and so the text on it) clockwise by deg in {0,90,180,270}."""
    if deg == 0:
        return img.copy()
    # Image.transpose(ROTATE_N) turns counter-clockwise by N degrees.
    ccw = {90: Image.Transpose.ROTATE_270, 180: Image.Transpose.ROTATE_180,
           270: Image.Transpose.ROTATE_90}[deg]
    return img.transpose(ccw)


def document_page(w=620, h=877):
    img = Image.new("RGB", (w, h), (255, 255, 255))
    d = ImageDraw.Draw(img)
    m = 48
    # Title: large, "bold" via a 1px stroke, centred.
    title = "Serving Models at Scale"
    tf = font(34)
    tw = d.textlength(title, font=tf)
    d.text(((w - tw) / 2, 50), title, fill=(0, 0, 0), font=tf,
           stroke_width=1, stroke_fill=(0, 0, 0))
    y = 120
    bf = font(14)
    step = 20

    def para(text, y):
        for line in wrap(d, text, bf, w - 2 * m):
            d.text((m, y), line, fill=(0, 0, 0), font=bf)
            y += step
        return y + 14

    y = para(BODY_TEXT, y)
    y = para(PARA2, y)

    # Figure: a framed box with a simple bar chart, then a caption.
    fx0, fy0, fx1, fy1 = m + 80, y + 4, w - m - 80, y + 184
    d.rectangle((fx0, fy0, fx1, fy1), outline=(0, 0, 0), width=2)
    rng = np.random.RandomState(7)
    heights = rng.randint(30, 150, size=8)
    bw = (fx1 - fx0 - 40) // 8
    for i, bh in enumerate(heights):
        bx = fx0 + 20 + i * bw
        d.rectangle((bx + 4, fy1 - 12 - bh, bx + bw - 4, fy1 - 12),
                    fill=(90, 90, 90))
    d.line((fx0 + 16, fy1 - 12, fx1 - 16, fy1 - 12), fill=(0, 0, 0), width=1)
    cap = "Figure 1. Requests per second for eight batch sizes."
    cf = font(13)
    d.text(((w - d.textlength(cap, font=cf)) / 2, fy1 + 8), cap, fill=(0, 0, 0), font=cf)
    y = fy1 + 40

    y = para(PARA3, y)

    # Table: caption above, 4 columns x 4 rows grid.
    tcap = "Table 1. Latency by model and batch size."
    d.text(((w - d.textlength(tcap, font=cf)) / 2, y), tcap, fill=(0, 0, 0), font=cf)
    y += 24
    cols = ["Model", "Batch", "p50 ms", "p99 ms"]
    rows = [["orientation", "1", "3.1", "4.0"],
            ["layout", "1", "41.7", "48.2"],
            ["minilm", "32", "55.0", "61.9"]]
    cw = (w - 2 * m - 80) // 4
    tx0 = m + 40
    rh = 24
    for r, row in enumerate([cols] + rows):
        for c, cell in enumerate(row):
            x0 = tx0 + c * cw
            y0 = y + r * rh
            d.rectangle((x0, y0, x0 + cw, y0 + rh), outline=(0, 0, 0), width=1)
            d.text((x0 + 8, y0 + 5), cell, fill=(0, 0, 0), font=bf)
    return img


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
    os.makedirs(out, exist_ok=True)
    page = text_page()
    for deg in (0, 90, 180, 270):
        rotate_cw(page, deg).save(os.path.join(out, f"text_{deg}.png"), optimize=False)
    rotate_cw(page, 90).save(os.path.join(out, "text_90.jpg"), quality=90)
    document_page().save(os.path.join(out, "page.png"), optimize=False)


if __name__ == "__main__":
    main()
