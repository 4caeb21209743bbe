"""A corpus of awkward and bad inputs: image files as bytes, questions, and request bodies."""
from __future__ import annotations

import io

import numpy as np
from PIL import Image


def encode(image: Image.Image, fmt: str = "PNG", **kwargs) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **kwargs)
    return buffer.getvalue()


def picture(size=(64, 48), mode="RGB") -> Image.Image:
    rng = np.random.RandomState(sum(size))
    array = (rng.rand(size[1], size[0], 3) * 255).astype("uint8")
    return Image.fromarray(array).convert(mode)


def exif_rotated_jpeg() -> bytes:
    image = picture((80, 40))
    exif = image.getexif()
    exif[0x0112] = 6  # orientation: rotate 90°
    return encode(image, "JPEG", exif=exif)


def animated_gif() -> bytes:
    frames = [picture((40, 40)).convert("P"), picture((41, 41)).resize((40, 40)).convert("P")]
    buffer = io.BytesIO()
    frames[0].save(buffer, format="GIF", save_all=True, append_images=frames[1:], duration=100, loop=0)
    return buffer.getvalue()


def sixteen_bit_png() -> bytes:
    array = (np.linspace(0, 65535, 64 * 64).reshape(64, 64)).astype(np.uint16)
    return encode(Image.fromarray(array))  # uint16 arrays become 16-bit grayscale images


def huge_png() -> bytes:
    """20000×20000 pixels in a few kilobytes: must be refused before it is decoded."""
    return encode(Image.new("1", (20000, 20000)))


#: name -> (image bytes, "ok" if the image must be answered, else a word of the expected error)
IMAGES = {
    "rgb": (lambda: encode(picture()), "ok"),
    "one-pixel": (lambda: encode(picture((1, 1))), "ok"),
    "one-by-ten-thousand": (lambda: encode(picture((1, 10000))), "ok"),
    "ten-thousand-by-one": (lambda: encode(picture((10000, 1))), "ok"),
    "cmyk-jpeg": (lambda: encode(picture(mode="CMYK"), "JPEG"), "ok"),
    "sixteen-bit": (sixteen_bit_png, "ok"),
    "palette": (lambda: encode(picture().convert("P")), "ok"),
    "alpha": (lambda: encode(picture(mode="RGBA")), "ok"),
    "grayscale": (lambda: encode(picture(mode="L")), "ok"),
    "animated-gif": (animated_gif, "ok"),
    "exif-rotated": (exif_rotated_jpeg, "ok"),
    "huge": (huge_png, "megapixels"),
    "zero-bytes": (lambda: b"", "empty"),
    "not-an-image": (lambda: b"%PDF-1.4 this is a document, not a picture", "image"),
    "truncated-png": (lambda: encode(picture((200, 200)))[:300], "image"),
    "truncated-jpeg": (lambda: encode(picture((200, 200)), "JPEG")[:200], "image"),
}

#: name -> (question, "ok" or a word of the expected error)
QUESTIONS = {
    "empty": ("", "empty"),
    "whitespace": ("   \n\t  ", "empty"),
    "very-long": ("why " * 25_000, "characters"),
    "control-characters": ("\x00\x07What\x1b is \x7fthis?", "ok"),
    "only-control-characters": ("\x00\x01\x02", "empty"),
}
