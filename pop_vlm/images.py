"""Turning what users pass as an image into an RGB PIL image, or a clear error."""
from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError


#: Images with more pixels than this are refused before they are decoded (POP_VLM_MAX_IMAGE_PIXELS). It stays
#: below Pillow's own decompression-bomb limit, which remains on.
MAX_IMAGE_PIXELS = int(os.environ.get("POP_VLM_MAX_IMAGE_PIXELS", 64_000_000))
#: Longer-than-wide (or wider-than-long) images beyond this ratio are padded with white to it: vision processors
#: refuse extreme aspect ratios (Qwen's at 200:1).
MAX_ASPECT_RATIO = 50


class ImageError(ValueError):
    """The image could not be read or is not usable."""


def load_image(image) -> Image.Image | None:
    """Accept a path, bytes, a binary file object, a PIL image or a numpy array (H×W, H×W×3 or H×W×4; uint8,
    16-bit, bool, or floats in [0, 1] or [0, 255])."""
    if image is None:
        return None
    if isinstance(image, str) and image.split(":", 1)[0].lower() in ("http", "https", "ftp", "data"):
        raise ImageError("image URLs are not fetched here: download the image and pass the file, its bytes or a "
                         "PIL image (the HTTP API fetches remote images only when the server allows it)")
    if isinstance(image, (str, os.PathLike)):
        path = Path(image)
        if path.is_dir():
            raise ImageError(f"{path} is a folder, not an image file")
        if not path.is_file():
            raise ImageError(f"image file not found: {path}")
        try:
            with Image.open(path) as opened:
                return to_rgb(opened)
        except Image.DecompressionBombError:
            raise ImageError(_too_large()) from None
        except (UnidentifiedImageError, OSError, SyntaxError) as err:
            raise ImageError(f"cannot read {path.name} as an image: {err}") from None
    if isinstance(image, (bytes, bytearray)):
        if not image:
            raise ImageError("the image is empty (0 bytes)")
        try:
            with Image.open(io.BytesIO(image)) as opened:
                return to_rgb(opened)
        except Image.DecompressionBombError:
            raise ImageError(_too_large()) from None
        except (UnidentifiedImageError, OSError, SyntaxError) as err:
            raise ImageError(f"cannot read the uploaded bytes as an image: {err}") from None
    if hasattr(image, "read") and not isinstance(image, Image.Image):  # an open binary file, BytesIO, an upload
        data = image.read()
        if not isinstance(data, (bytes, bytearray)):
            raise ImageError("the file object gave text, not bytes: open image files in binary mode ('rb')")
        return load_image(bytes(data))
    if isinstance(image, Image.Image):
        return to_rgb(image)
    if isinstance(image, np.ndarray):
        return to_rgb(Image.fromarray(_array_to_uint8(image)))
    raise ImageError(f"unsupported image type {type(image).__name__}: pass a path, bytes, a binary file, a PIL "
                     "image or a numpy array")


def _too_large() -> str:
    return (f"the image is too large to decode safely (Pillow's decompression-bomb guard); the limit is "
            f"{MAX_IMAGE_PIXELS / 1e6:.0f} megapixels")


def to_rgb(image: Image.Image) -> Image.Image:
    """First frame, EXIF orientation applied, alpha composited on white, 16-bit scaled down, as RGB."""
    width, height = image.size
    if width * height > MAX_IMAGE_PIXELS:
        raise ImageError(
            f"the image is {width}×{height} = {width * height / 1e6:.0f} megapixels; the limit is "
            f"{MAX_IMAGE_PIXELS / 1e6:.0f} megapixels"
        )
    try:
        image.seek(0)
    except (AttributeError, EOFError):
        pass
    try:
        image.load()
    except Image.DecompressionBombError:
        raise ImageError(_too_large()) from None
    except (OSError, SyntaxError, ValueError) as err:
        raise ImageError(f"the image data is corrupt or truncated: {err}") from None
    image = ImageOps.exif_transpose(image) or image
    if image.width < 1 or image.height < 1:
        raise ImageError("the image has no pixels")
    if image.mode in ("I;16", "I;16B", "I;16L", "I"):
        array = np.asarray(image, dtype=np.float64)
        top = array.max() if array.max() > 255 else 255.0
        image = Image.fromarray((array / top * 255.0).clip(0, 255).astype(np.uint8))
    if image.mode == "P":
        image = image.convert("RGBA")
    if image.mode in ("RGBA", "LA", "PA"):
        background = Image.new("RGB", image.size, (255, 255, 255))
        background.paste(image.convert("RGBA"), mask=image.convert("RGBA").getchannel("A"))
        return background
    return image.convert("RGB")


def _array_to_uint8(array: np.ndarray) -> np.ndarray:
    if array.ndim == 3 and array.shape[2] == 1:
        array = array[..., 0]
    if array.ndim not in (2, 3) or (array.ndim == 3 and array.shape[2] not in (3, 4)):
        hint = (" (channels first: pass array.transpose(1, 2, 0))"
                if array.ndim == 3 and array.shape[0] in (1, 3, 4) else "")
        raise ImageError(f"an image array must be H×W, H×W×3 or H×W×4; got shape {array.shape}{hint}")
    if array.size == 0:
        raise ImageError("the image array is empty")
    if array.dtype == np.uint8:
        return array
    if np.issubdtype(array.dtype, np.floating):
        if not np.isfinite(array).all():
            raise ImageError("the image array has NaN or infinite values")
        low, high = float(array.min()), float(array.max())
        if low < 0.0 or high > 255.0:
            # no scale to guess from: clipping would feed the model a different picture
            raise ImageError(f"a float image array must hold values in [0, 1] or [0, 255]; this one spans "
                             f"[{low:g}, {high:g}]")
        if high <= 1.0:
            array = array * 255.0
        return array.round().astype(np.uint8)
    if np.issubdtype(array.dtype, np.integer):
        low, high = int(array.min()), int(array.max())
        if low < 0 or high > 65535:
            raise ImageError(f"an integer image array must hold values in [0, 255] or [0, 65535]; this one spans "
                             f"[{low}, {high}]")
        top = 65535 if high > 255 else 255
        return (array.astype(np.float64) / top * 255.0).clip(0, 255).round().astype(np.uint8)
    if array.dtype == np.bool_:
        return array.astype(np.uint8) * 255
    raise ImageError(f"unsupported image array dtype {array.dtype}")


#: images with more than this many times the processor's pixel budget are downscaled before the processor (to
#: that size): preprocessing a huge image costs more than the model's work; below it the processor's own resize
#: sees the original pixels, as in training
PRESCALE_FACTOR = 16


def fit_image(image: Image.Image, max_pixels: int | None) -> Image.Image:
    """Pad extreme aspect ratios with white, and downscale images far beyond the processor's pixel budget, so
    that every readable image reaches the model at a reasonable preprocessing cost."""
    width, height = image.size
    if max(width, height) > MAX_ASPECT_RATIO * min(width, height):
        side = max(width, height)
        new_size = (side, -(-side // MAX_ASPECT_RATIO)) if width >= height else (-(-side // MAX_ASPECT_RATIO), side)
        canvas = Image.new("RGB", new_size, (255, 255, 255))
        canvas.paste(image, ((new_size[0] - width) // 2, (new_size[1] - height) // 2))
        image, (width, height) = canvas, new_size
    if max_pixels and width * height > PRESCALE_FACTOR * max_pixels:
        scale = (PRESCALE_FACTOR * max_pixels / (width * height)) ** 0.5
        image = image.resize((max(1, int(width * scale)), max(1, int(height * scale))), Image.Resampling.BICUBIC)
    return image
