from eaas.cli import app

app()
