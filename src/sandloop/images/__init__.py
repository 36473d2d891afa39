"""Runtime images: the recipe (recipe/), its content hash, and the offline build."""

from sandloop.recipe_hash import RECIPE_DIR, base_tag, default_runtime_image, recipe_hash

__all__ = ["RECIPE_DIR", "base_tag", "default_runtime_image", "recipe_hash"]
