"""Images of a sample: decoded to uint8 [3, H, W] in the worker, placeholders put into its tokens.

Decoding uses Pillow (the optional extra `omniload[vision]`): the image is converted to RGB,
scaled so that it covers H x W and center-cropped to it (`--image-size HxW`), or handed to the
user's `module:function` (`--image-transform`), which takes a PIL image and returns uint8
[3, H, W]. A JPEG is decoded at a reduced scale when the target is much smaller (Pillow's
draft mode), which is most of the time spent on large photos.

Where the images go in the text: each `<image>` in the text marks one image, in order; a text
without markers gets its images before the text. Each image becomes `--tokens-per-image`
copies of `--image-token` in the sample's tokens.
"""

from __future__ import annotations

import importlib
import io
import struct
from collections.abc import Callable, Sequence

import numpy as np

from omniload.errors import ConfigError
from omniload.formats.lane_config import ImageConfig

IMAGE_MARKER = "<image>"

ImageTransform = Callable[[bytes], np.ndarray]  # encoded image -> uint8 [3, H, W]
# What decoding raises when the image's bytes are at fault (truncated, not an image, a bomb):
# that sample is bad (--on-bad-file), the worker is fine.
DECODE_ERRORS = (OSError, ValueError, SyntaxError, EOFError, struct.error)


def require_pillow(source: str) -> None:
    """Raise ConfigError naming the fix when Pillow is not installed."""
    try:
        import PIL.Image  # noqa: F401
    except ImportError:
        raise ConfigError(f"source '{source}' has images, which need Pillow: pip install 'omniload[vision]'") from None


def load_image_transform(config: ImageConfig) -> ImageTransform:
    """The decoder for a job's images; raises ConfigError when --image-transform cannot load."""
    from PIL import Image, ImageOps

    Image.MAX_IMAGE_PIXELS = 1 << 28  # a 16k x 16k image decodes; larger ones are rejected as bombs
    size = (config.width, config.height)
    user = _user_function(config.transform) if config.transform else None

    def decode(data: bytes) -> np.ndarray:
        try:
            with Image.open(io.BytesIO(data)) as image:
                if user is not None:
                    return _checked(user(image), config)
                image.draft("RGB", size)  # JPEG: decode at the smallest scale still covering the target
                fitted = ImageOps.fit(image.convert("RGB"), size, Image.Resampling.BICUBIC)
                return np.asarray(fitted, dtype=np.uint8).transpose(2, 0, 1)
        except Image.DecompressionBombError as exc:
            raise ValueError(str(exc)) from None

    return decode


def _user_function(name: str) -> Callable:
    module, sep, func = name.partition(":")
    if not sep or not module or not func:
        raise ConfigError(f"image-transform {name!r}: expected module:function")
    try:
        return getattr(importlib.import_module(module), func)
    except ImportError as exc:
        raise ConfigError(f"image-transform {name!r}: cannot import module '{module}': {exc}") from None
    except AttributeError:
        raise ConfigError(f"image-transform {name!r}: module '{module}' has no function '{func}'") from None


def _checked(pixels: object, config: ImageConfig) -> np.ndarray:
    array = np.asarray(pixels)
    want = (3, config.height, config.width)
    if array.shape != want or array.dtype != np.uint8:
        raise ValueError(
            f"--image-transform returned {array.dtype} {list(array.shape)}; expected uint8 {list(want)} "
            "(the --image-size)"
        )
    return array


def text_pieces(text: str) -> list[str]:
    """The text between image markers (one more piece than markers)."""
    return text.split(IMAGE_MARKER)


def place_images(pieces: Sequence[np.ndarray], images: int, config: ImageConfig) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, where each image's placeholders start) from the tokenized pieces of a text.
    Raises ValueError when the markers do not match the images."""
    placeholder = np.full(config.tokens_per_image, config.token, dtype=np.int32)
    if len(pieces) == 1:  # no markers: the images lead
        parts = [placeholder] * images + [pieces[0]]
    elif len(pieces) - 1 == images:
        parts = [pieces[0]]
        for piece in pieces[1:]:
            parts += [placeholder, piece]
    else:
        raise ValueError(f"the text has {len(pieces) - 1} {IMAGE_MARKER} markers for {images} images")
    tokens = np.concatenate(parts).astype(np.int32, copy=False) if parts else np.zeros(0, np.int32)
    lengths = np.array([len(p) for p in parts], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    is_image = np.array([p is placeholder for p in parts])
    return tokens, starts[is_image].astype(np.int32)
