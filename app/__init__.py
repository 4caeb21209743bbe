"""The pop-vlm web app and HTTP server; they call only the public `pop_vlm` API."""
