"""API Gateway -> Lambda -> the FastAPI app, through Mangum. No torch here."""

from aws_lambda_powertools import Logger, Tracer
from mangum import Mangum

from sluice.api.app import create_app

logger = Logger(service="sluice-api")
tracer = Tracer(service="sluice-api")
app = Mangum(create_app(), lifespan="off", api_gateway_base_path=None)


@logger.inject_lambda_context(correlation_id_path="requestContext.requestId")
# Responses hold results, client metadata and presigned result URLs: they stay
# out of the traces, as the stage keeps bodies out of its logs.
@tracer.capture_lambda_handler(capture_response=False)
def handler(event, context):
    return app(event, context)
