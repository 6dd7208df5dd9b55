"""Small helpers shared by every layer: user-facing errors, suggestions, package paths, a free TCP port."""
