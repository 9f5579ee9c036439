"""API Gateway -> Lambda -> the FastAPI app, through Mangum. No torch here."""

from aws_lambda_powertools import Logger, Tracer
from aws_lambda_powertools.logging.utils import copy_config_to_registered_loggers
from mangum import Mangum

from sluice.api.app import create_app

logger = Logger(service="sluice-api")
# Sluice's own modules log through logging.getLogger("sluice.*"): their lines get
# this logger's JSON and Lambda context (request id, correlation id) too.
copy_config_to_registered_loggers(source_logger=logger, include={"sluice"})
tracer = Tracer(service="sluice-api")
app = Mangum(create_app(), lifespan="off", api_gateway_base_path=None)


@logger.inject_lambda_context(correlation_id_path="requestContext.requestId")
# Responses hold results, client metadata and presigned result URLs: they stay
# out of the traces, as the stage keeps bodies out of its logs.
@tracer.capture_lambda_handler(capture_response=False)
def handler(event, context):
    return app(event, context)
