"""Renderers: turn computed results into text, markdown or JSON. They format; they never compute."""
