"""The serving layer: HTTP protocols, request planning, the completion executor and sink."""
