"""The web page served at `/` (plain HTML and JS, no build step)."""
