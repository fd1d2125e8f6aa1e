from app import native

native.install()  # compiled twin modules, where built and unchanged since (app/native.py)
