//! Image pre-processing: the one implementation of decode, EXIF orientation, resize, crop,
//! letterbox and normalization that every route uses.
//!
//! Resizing is separable and aligns pixel centres (`align_corners = false`): output pixel `x`
//! samples source position `(x + 0.5) * scale - 0.5`. Bilinear and bicubic clamp at the borders
//! and do not antialias when shrinking, as OpenCV's `INTER_LINEAR`/`INTER_CUBIC` do; results are
//! rounded back to 8 bits after each resize, as OpenCV does for 8-bit images, so a model sees
//! what it saw in training.

use std::io::Cursor;

use image::ImageDecoder;
use repo::pipeline::{ChannelOrder, Interpolation, Layout, Preprocess, ResizeMode};

use crate::error::ClassicError;

/// An 8-bit RGB image, row-major, 3 bytes per pixel.
#[derive(Debug, Clone, PartialEq)]
pub struct Rgb {
    pub width: usize,
    pub height: usize,
    pub pixels: Vec<u8>,
}

/// Maps coordinates of the network input back to the original image: `orig = (x - offset) / scale`
/// per axis.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Transform {
    pub scale_x: f32,
    pub scale_y: f32,
    pub offset_x: f32,
    pub offset_y: f32,
    /// The original image size (after EXIF orientation).
    pub width: usize,
    pub height: usize,
}

impl Transform {
    fn identity(width: usize, height: usize) -> Self {
        Transform {
            scale_x: 1.0,
            scale_y: 1.0,
            offset_x: 0.0,
            offset_y: 0.0,
            width,
            height,
        }
    }

    /// A box `[x1, y1, x2, y2]` in network coordinates → original pixels, clipped to the image.
    pub fn to_original(&self, b: [f32; 4]) -> [f32; 4] {
        let x = |v: f32| ((v - self.offset_x) / self.scale_x).clamp(0.0, self.width as f32);
        let y = |v: f32| ((v - self.offset_y) / self.scale_y).clamp(0.0, self.height as f32);
        [x(b[0]), y(b[1]), x(b[2]), y(b[3])]
    }
}

/// Largest decoded image accepted (pixels), so a small file cannot ask for gigabytes.
pub const MAX_PIXELS: u64 = 64 * 1024 * 1024;

/// Decodes a JPEG or PNG and applies its EXIF orientation when `exif` is set.
pub fn decode(bytes: &[u8], exif: bool) -> Result<Rgb, ClassicError> {
    let bad = |e: String| ClassicError::BadInput(format!("cannot decode the image: {e}"));
    if bytes.is_empty() {
        return Err(bad("the image is empty (0 bytes)".into()));
    }
    let reader = image::ImageReader::new(Cursor::new(bytes))
        .with_guessed_format()
        .map_err(|e| bad(e.to_string()))?;
    match reader.format() {
        Some(image::ImageFormat::Jpeg | image::ImageFormat::Png) => {}
        Some(other) => {
            return Err(bad(format!(
                "{other:?} images are not accepted (JPEG or PNG)"
            )))
        }
        None => return Err(bad("not a JPEG or PNG file".into())),
    }
    let mut decoder = reader.into_decoder().map_err(|e| bad(e.to_string()))?;
    let (w, h) = decoder.dimensions();
    if w == 0 || h == 0 {
        return Err(bad(format!("the image is {w}x{h} pixels")));
    }
    if u64::from(w) * u64::from(h) > MAX_PIXELS {
        return Err(bad(format!(
            "the image is {w}x{h} pixels, more than the {MAX_PIXELS} accepted"
        )));
    }
    let orientation = if exif {
        decoder.orientation().ok()
    } else {
        None
    };
    let mut img = image::DynamicImage::from_decoder(decoder).map_err(|e| bad(e.to_string()))?;
    if let Some(o) = orientation {
        img.apply_orientation(o);
    }
    let rgb = img.into_rgb8();
    Ok(Rgb {
        width: rgb.width() as usize,
        height: rgb.height() as usize,
        pixels: rgb.into_raw(),
    })
}

/// Taps of one output coordinate: the first source index and its weights.
struct Taps {
    start: Vec<usize>,
    weights: Vec<f32>,
    width: usize,
    /// `start` is shifted up by this much (filters whose first tap can lie before 0).
    back: i64,
}

fn taps(src: usize, dst: usize, interpolation: Interpolation) -> Taps {
    let scale = src as f64 / dst as f64;
    let last = src as i64 - 1;
    let clamp = |i: i64| i.clamp(0, last) as usize;
    match interpolation {
        Interpolation::Nearest => {
            let start = (0..dst)
                .map(|x| clamp(((x as f64 + 0.5) * scale).floor() as i64))
                .collect();
            Taps {
                start,
                weights: vec![1.0; dst],
                width: 1,
                back: 0,
            }
        }
        Interpolation::Area if scale > 1.0 => {
            // Each output pixel averages the source interval it covers.
            let width = scale.ceil() as usize + 1;
            let mut start = Vec::with_capacity(dst);
            let mut weights = vec![0f32; dst * width];
            for x in 0..dst {
                let (lo, hi) = (x as f64 * scale, (x as f64 + 1.0) * scale);
                let first = lo.floor() as usize;
                start.push(first);
                for k in 0..width {
                    let s = (first + k) as f64;
                    let overlap = (hi.min(s + 1.0) - lo.max(s)).max(0.0);
                    if first + k < src {
                        weights[x * width + k] = (overlap / scale) as f32;
                    }
                }
            }
            Taps {
                start,
                weights,
                width,
                back: 0,
            }
        }
        Interpolation::Bilinear | Interpolation::Area => {
            let mut start = Vec::with_capacity(dst);
            let mut weights = Vec::with_capacity(dst * 2);
            for x in 0..dst {
                let f = (x as f64 + 0.5) * scale - 0.5;
                let mut i = f.floor() as i64;
                let mut t = f - i as f64;
                if i < 0 {
                    i = 0;
                    t = 0.0;
                }
                if i >= last {
                    i = last;
                    t = 0.0;
                }
                start.push(i as usize);
                weights.push((1.0 - t) as f32);
                weights.push(t as f32);
            }
            Taps {
                start,
                weights,
                width: 2,
                back: 0,
            }
        }
        Interpolation::Lanczos => {
            let lanczos = |t: f64| {
                if t.abs() < 1e-9 {
                    1.0
                } else {
                    let pt = std::f64::consts::PI * t;
                    (pt.sin() * (pt / 4.0).sin()) / (pt * pt / 4.0)
                }
            };
            let mut start = Vec::with_capacity(dst);
            let mut weights = Vec::with_capacity(dst * 8);
            for x in 0..dst {
                let f = (x as f64 + 0.5) * scale - 0.5;
                let i = f.floor() as i64;
                let t = f - i as f64;
                // Taps i-3..=i+4; `start` holds i+3 (never negative), `tap_index` clamps.
                start.push((i + 3).max(0) as usize);
                let w: Vec<f64> = (0..8).map(|k| lanczos(t + 3.0 - k as f64)).collect();
                let sum: f64 = w.iter().sum();
                weights.extend(w.iter().map(|v| (v / sum) as f32));
            }
            Taps {
                start,
                weights,
                width: 8,
                back: 6,
            }
        }
        Interpolation::Bicubic => {
            const A: f64 = -0.75;
            let cubic = |x: f64| {
                let x = x.abs();
                if x <= 1.0 {
                    ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
                } else if x < 2.0 {
                    ((A * x - 5.0 * A) * x + 8.0 * A) * x - 4.0 * A
                } else {
                    0.0
                }
            };
            let mut start = Vec::with_capacity(dst);
            let mut weights = Vec::with_capacity(dst * 4);
            for x in 0..dst {
                let f = (x as f64 + 0.5) * scale - 0.5;
                let i = f.floor() as i64;
                let t = f - i as f64;
                // Taps i-1..=i+2; `start` holds i+1 (never negative), `tap_index` clamps.
                start.push((i + 1).max(0) as usize);
                for k in -1..=2i64 {
                    weights.push(cubic(t - k as f64) as f32);
                }
            }
            Taps {
                start,
                weights,
                width: 4,
                back: 2,
            }
        }
    }
}

/// Source index of tap `k` for output `x`: bicubic and Lanczos store their centre tap shifted
/// up by one and three, and clamp at the borders (replicated edge).
#[inline]
fn tap_index(taps: &Taps, x: usize, k: usize, src: usize) -> usize {
    (taps.start[x] as i64 - taps.back + k as i64).clamp(0, src as i64 - 1) as usize
}

/// Resizes to `width` × `height`.
pub fn resize(img: &Rgb, width: usize, height: usize, interpolation: Interpolation) -> Rgb {
    if img.width == width && img.height == height {
        return img.clone();
    }
    let tx = taps(img.width, width, interpolation);
    let ty = taps(img.height, height, interpolation);
    // Horizontal pass into f32 rows, then vertical pass with rounding to 8 bits.
    let mut mid = vec![0f32; img.height * width * 3];
    for y in 0..img.height {
        let row = &img.pixels[y * img.width * 3..(y + 1) * img.width * 3];
        let out = &mut mid[y * width * 3..(y + 1) * width * 3];
        for x in 0..width {
            let mut acc = [0f32; 3];
            for k in 0..tx.width {
                let w = tx.weights[x * tx.width + k];
                if w == 0.0 {
                    continue;
                }
                let s = tap_index(&tx, x, k, img.width) * 3;
                for c in 0..3 {
                    acc[c] += w * f32::from(row[s + c]);
                }
            }
            out[x * 3..x * 3 + 3].copy_from_slice(&acc);
        }
    }
    let mut pixels = vec![0u8; height * width * 3];
    for y in 0..height {
        let out = &mut pixels[y * width * 3..(y + 1) * width * 3];
        let mut acc = vec![0f32; width * 3];
        for k in 0..ty.width {
            let w = ty.weights[y * ty.width + k];
            if w == 0.0 {
                continue;
            }
            let s = tap_index(&ty, y, k, img.height);
            let row = &mid[s * width * 3..(s + 1) * width * 3];
            for (a, v) in acc.iter_mut().zip(row) {
                *a += w * v;
            }
        }
        for (o, a) in out.iter_mut().zip(&acc) {
            *o = a.round().clamp(0.0, 255.0) as u8;
        }
    }
    Rgb {
        width,
        height,
        pixels,
    }
}

/// Centre crop to `width` × `height`: the top-left corner at `floor((size - crop) / 2)`, black
/// where the image is smaller. Returns the crop's top-left offset in the source.
pub fn center_crop(img: &Rgb, width: usize, height: usize) -> (Rgb, i64, i64) {
    let left = (img.width as i64 - width as i64).div_euclid(2);
    let top = (img.height as i64 - height as i64).div_euclid(2);
    let mut pixels = vec![0u8; width * height * 3];
    for y in 0..height {
        let sy = top + y as i64;
        if sy < 0 || sy >= img.height as i64 {
            continue;
        }
        for x in 0..width {
            let sx = left + x as i64;
            if sx < 0 || sx >= img.width as i64 {
                continue;
            }
            let s = (sy as usize * img.width + sx as usize) * 3;
            pixels[(y * width + x) * 3..(y * width + x) * 3 + 3]
                .copy_from_slice(&img.pixels[s..s + 3]);
        }
    }
    (
        Rgb {
            width,
            height,
            pixels,
        },
        left,
        top,
    )
}

/// The image prepared for the network: a `[1, 3, H, W]` (or `[1, H, W, 3]`) f32 tensor's data and
/// the coordinate transform back to the original.
pub struct Prepared {
    pub data: Vec<f32>,
    pub shape: [usize; 4],
    pub transform: Transform,
    /// The decoded image's statistics for the monitors, when asked for.
    pub observation: Option<record::Observation>,
    /// Time spent decoding the encoded bytes (0 when given decoded pixels); the rest of the
    /// preparation is pre-processing (the traces show the two apart).
    pub decode_seconds: f64,
}

/// Runs the declared steps on encoded image bytes; with `observe`, also measures the decoded
/// image for the monitors (before any resize).
pub fn prepare(
    bytes: &[u8],
    spec: &Preprocess,
    observe: Option<crate::model::ImageFeatures>,
) -> Result<Prepared, ClassicError> {
    let began = std::time::Instant::now();
    let img = decode(bytes, spec.exif_orientation)?;
    let decode_seconds = began.elapsed().as_secs_f64();
    let observation = observe
        .map(|features| features(&img.pixels, img.width, img.height, (img.width, img.height)));
    let mut p = prepare_rgb(img, spec)?;
    p.observation = observation;
    p.decode_seconds = decode_seconds;
    Ok(p)
}

/// Runs the declared steps after decoding.
pub fn prepare_rgb(mut img: Rgb, spec: &Preprocess) -> Result<Prepared, ClassicError> {
    let mut t = Transform::identity(img.width, img.height);
    if let Some(r) = &spec.resize {
        let (w, h) = (img.width as f64, img.height as f64);
        let size = |s: Option<u32>| s.unwrap_or(1) as f64;
        let target = match r.mode {
            ResizeMode::Exact => (size(r.width), size(r.height)),
            ResizeMode::ShortSide => {
                let s = size(r.size) / w.min(h);
                ((w * s).round_ties_even(), (h * s).round_ties_even())
            }
            ResizeMode::LongSide => {
                let s = size(r.size) / w.max(h);
                ((w * s).round_ties_even(), (h * s).round_ties_even())
            }
            ResizeMode::Letterbox => {
                let s = (size(r.width) / w).min(size(r.height) / h);
                ((w * s).round_ties_even(), (h * s).round_ties_even())
            }
        };
        let (tw, th) = (target.0.max(1.0) as usize, target.1.max(1.0) as usize);
        let resized = resize(&img, tw, th, r.interpolation);
        t.scale_x = tw as f32 / img.width as f32;
        t.scale_y = th as f32 / img.height as f32;
        img = resized;
        if r.mode == ResizeMode::Letterbox {
            let (bw, bh) = (size(r.width) as usize, size(r.height) as usize);
            let (left, top) = ((bw - tw) / 2, (bh - th) / 2);
            let mut pixels = Vec::with_capacity(bw * bh * 3);
            for _ in 0..bw * bh {
                pixels.extend_from_slice(&r.fill);
            }
            for y in 0..th {
                let dst = ((y + top) * bw + left) * 3;
                pixels[dst..dst + tw * 3]
                    .copy_from_slice(&img.pixels[y * tw * 3..(y + 1) * tw * 3]);
            }
            img = Rgb {
                width: bw,
                height: bh,
                pixels,
            };
            t.offset_x = left as f32;
            t.offset_y = top as f32;
        }
    }
    if let Some(crop) = spec.crop {
        let (cropped, left, top) = center_crop(&img, crop.width as usize, crop.height as usize);
        t.offset_x -= left as f32;
        t.offset_y -= top as f32;
        img = cropped;
    }
    let (w, h) = (img.width, img.height);
    let order: [usize; 3] = match spec.channel_order {
        ChannelOrder::Rgb => [0, 1, 2],
        ChannelOrder::Bgr => [2, 1, 0],
    };
    let mul: [f32; 3] = std::array::from_fn(|c| spec.scale / spec.std[c]);
    let add: [f32; 3] = std::array::from_fn(|c| -spec.mean[c] / spec.std[c]);
    let mut data = vec![0f32; w * h * 3];
    match spec.layout {
        Layout::Nchw => {
            for c in 0..3 {
                let plane = &mut data[c * w * h..(c + 1) * w * h];
                let src = order[c];
                for (i, v) in plane.iter_mut().enumerate() {
                    *v = f32::from(img.pixels[i * 3 + src]) * mul[c] + add[c];
                }
            }
        }
        Layout::Nhwc => {
            for i in 0..w * h {
                for c in 0..3 {
                    data[i * 3 + c] = f32::from(img.pixels[i * 3 + order[c]]) * mul[c] + add[c];
                }
            }
        }
    }
    let shape = match spec.layout {
        Layout::Nchw => [1, 3, h, w],
        Layout::Nhwc => [1, h, w, 3],
    };
    Ok(Prepared {
        data,
        shape,
        transform: t,
        observation: None,
        decode_seconds: 0.0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gradient(w: usize, h: usize) -> Rgb {
        let mut pixels = Vec::new();
        for y in 0..h {
            for x in 0..w {
                pixels.extend_from_slice(&[
                    (x * 255 / (w - 1)) as u8,
                    (y * 255 / (h - 1)) as u8,
                    77,
                ]);
            }
        }
        Rgb {
            width: w,
            height: h,
            pixels,
        }
    }

    #[test]
    fn bilinear_halving_averages_pixel_pairs() {
        // align_corners=false at scale 2: output x samples source 2x+0.5, the mean of 2x and 2x+1.
        let img = Rgb {
            width: 4,
            height: 1,
            pixels: vec![0, 0, 0, 100, 100, 100, 200, 200, 200, 250, 250, 250],
        };
        let out = resize(&img, 2, 1, Interpolation::Bilinear);
        assert_eq!(out.pixels, vec![50, 50, 50, 225, 225, 225]);
    }

    #[test]
    fn bilinear_enlarging_clamps_at_the_borders() {
        let img = Rgb {
            width: 2,
            height: 1,
            pixels: vec![0, 0, 0, 100, 100, 100],
        };
        let out = resize(&img, 4, 1, Interpolation::Bilinear);
        // Source positions -0.25 (clamped to 0), 0.25, 0.75, 1.25 (clamped to 1).
        assert_eq!(
            out.pixels.iter().step_by(3).copied().collect::<Vec<_>>(),
            vec![0, 25, 75, 100]
        );
    }

    #[test]
    fn every_filter_keeps_a_flat_image_flat_and_sizes_right() {
        let img = Rgb {
            width: 7,
            height: 5,
            pixels: vec![123; 7 * 5 * 3],
        };
        for f in [
            Interpolation::Nearest,
            Interpolation::Bilinear,
            Interpolation::Bicubic,
            Interpolation::Area,
            Interpolation::Lanczos,
        ] {
            for (w, h) in [(3, 2), (14, 11), (7, 5), (1, 1)] {
                let out = resize(&img, w, h, f);
                assert_eq!((out.width, out.height), (w, h));
                assert!(out.pixels.iter().all(|p| *p == 123), "{f:?} {w}x{h}");
            }
        }
        let g = gradient(9, 6);
        let area = resize(&g, 3, 2, Interpolation::Area);
        // Each output pixel is the mean of a 3x3 block of the red ramp 0,31,63,...
        assert_eq!(area.pixels[0], ((31 + 63) as f32 / 3.0).round() as u8);
    }

    #[test]
    fn letterbox_maps_boxes_back_to_the_original() {
        let spec: Preprocess = toml::from_str(
            "input = \"x\"\nresize = { mode = \"letterbox\", width = 64, height = 64 }",
        )
        .unwrap();
        let p = prepare_rgb(gradient(128, 64), &spec).unwrap();
        assert_eq!(p.shape, [1, 3, 64, 64]);
        assert_eq!(p.transform.offset_y, 16.0);
        let b = p.transform.to_original([0.0, 16.0, 64.0, 48.0]);
        assert_eq!(b, [0.0, 0.0, 128.0, 64.0]);
        // The padding is the fill colour 114, normalized with scale 1/255.
        assert!((p.data[0] - 114.0 / 255.0).abs() < 1e-6);
    }

    #[test]
    fn short_side_then_crop_normalizes_in_bgr() {
        let spec: Preprocess = toml::from_str(
            "input = \"x\"\nresize = { mode = \"short_side\", size = 32 }\ncrop = { width = 32, height = 32 }\nchannel_order = \"bgr\"\nmean = [0.5, 0.5, 0.5]\nstd = [0.5, 0.5, 0.5]",
        )
        .unwrap();
        let p = prepare_rgb(gradient(64, 48), &spec).unwrap();
        assert_eq!(p.shape, [1, 3, 32, 32]);
        // Channel 0 is blue (77 everywhere): (77/255 - 0.5) / 0.5.
        assert!((p.data[0] - (77.0 / 255.0 - 0.5) / 0.5).abs() < 1e-6);
        assert!(p.data.iter().all(|v| (-1.0..=1.0).contains(v)));
    }

    #[test]
    fn bad_images_are_precise_errors() {
        for (bytes, want) in [
            (&b""[..], "0 bytes"),
            (&b"not an image at all"[..], "not a JPEG or PNG"),
            (&b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR\0\0"[..], "cannot decode"),
        ] {
            let e = decode(bytes, true).unwrap_err().to_string();
            assert!(e.contains(want), "{e}");
        }
    }
}
