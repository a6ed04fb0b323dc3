"""Where models are on this machine: moed's own folders, Ollama's store, the Hugging Face cache and LM Studio's
folder, read in place (``catalog.Catalog``); and getting new ones from the Hub (``hub_pull``)."""
