# CPU image for every STAR service (the service is chosen by the command).
FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 STAR_HOME=/var/star
WORKDIR /app
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml README.md ./
COPY services ./services
RUN pip install --no-cache-dir .
EXPOSE 8000
CMD ["star", "sandbox", "serve", "--host", "0.0.0.0", "--port", "8000"]
