"""The playground page at `/`, driven in a real headless Chromium (Selenium) against a running gpt.serve.

Needs Chromium and its driver: `.ci/run` installs Debian's `chromium` and `chromium-driver` where it
can (`apt-get install chromium chromium-driver`); without them these tests are skipped, saying so.
"""

import shutil
import time

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install -e '.[serve]'")
selenium = pytest.importorskip("selenium", reason="selenium is not installed: pip install -e '.[dev]'")
from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

from gpt import load_checkpoint  # noqa: E402
from gpt.infer.sampling import complete  # noqa: E402
from gpt.serve.app import ServeConfig, create_app, running  # noqa: E402

NAME = "shakespeare-char"


@pytest.fixture(scope="module")
def browser():
    chromium = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
    driver = shutil.which("chromedriver")
    if not chromium or not driver:
        pytest.skip(
            "no Chromium or chromedriver on this machine (Debian: apt-get install chromium chromium-driver; "
            ".ci/run does this where it can)"
        )
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(arg)
    b = webdriver.Chrome(service=Service(driver), options=options)
    b.set_page_load_timeout(30)
    yield b
    b.quit()


@pytest.fixture(scope="module")
def served(trained_run):
    model, tok, meta = load_checkpoint(trained_run)
    app = create_app(model, tok, meta, ServeConfig(model_name=NAME, max_tokens=100000))
    with running(app) as url:
        yield url, app, (model, tok)


def fill(browser, field, value):
    element = browser.find_element(By.ID, field)
    element.clear()
    element.send_keys(str(value))


def text_of(browser, id_):
    return browser.find_element(By.ID, id_).text


def test_playground_streams_a_completion_with_tokens_per_second(browser, served):
    url, _, (model, tok) = served
    browser.get(url + "/")
    WebDriverWait(browser, 20).until(lambda b: NAME in text_of(b, "model"))
    fill(browser, "prompt", "ROMEO:")
    fill(browser, "max_tokens", 40)
    fill(browser, "temperature", 0)
    browser.find_element(By.ID, "top_k").clear()
    browser.find_element(By.ID, "generate").click()
    WebDriverWait(browser, 30).until(lambda b: "finished" in text_of(b, "stats"))
    expected = complete(model, tok, "ROMEO:", max_new_tokens=40, temperature=0, top_k=None)[0]
    output = browser.find_element(By.ID, "output").get_attribute("textContent")
    assert output == "ROMEO:" + expected
    stats = text_of(browser, "stats")
    assert stats.startswith("40 tokens in ") and "tokens/s" in stats and "finished: length" in stats
    assert text_of(browser, "error") == ""


def test_playground_stop_button_frees_the_server_and_errors_are_shown(browser, served):
    url, app, _ = served
    browser.get(url + "/")
    WebDriverWait(browser, 20).until(lambda b: NAME in text_of(b, "model"))
    # long and greedy: it must still be running at the click (sampled, the char model can draw end-of-text)
    fill(browser, "max_tokens", 100000)
    fill(browser, "temperature", 0)
    browser.find_element(By.ID, "generate").click()
    WebDriverWait(browser, 30).until(lambda b: "tokens/s" in text_of(b, "stats"))
    browser.find_element(By.ID, "stop-button").click()
    WebDriverWait(browser, 10).until(lambda b: "(stopped)" in text_of(b, "stats"))
    deadline = time.monotonic() + 10
    while app.state.worker.load["rows"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert app.state.worker.load["rows"] == 0

    fill(browser, "temperature", 5)
    browser.find_element(By.ID, "generate").click()
    WebDriverWait(browser, 10).until(lambda b: text_of(b, "error"))
    assert "temperature" in text_of(browser, "error") and "less than or equal to 2" in text_of(browser, "error")


@pytest.fixture(scope="module")
def chat_served(chat_run):
    model, tok, meta = load_checkpoint(chat_run)
    with running(create_app(model, tok, meta, ServeConfig(model_name="chat", max_tokens=100))) as url:
        yield url, (model, tok, meta)


def test_playground_chat_view_holds_a_conversation(browser, chat_served):
    from gpt.infer.chat import Chat, chat_template
    from gpt.infer.sampling import SampleConfig

    url, (model, tok, meta) = chat_served
    browser.get(url + "/")
    WebDriverWait(browser, 20).until(lambda b: "(chat)" in text_of(b, "model"))
    assert browser.find_element(By.ID, "mode-chat").is_selected()  # a chat model opens in the chat view
    assert not browser.find_element(By.ID, "prompt").is_displayed()
    fill(browser, "max_tokens", 30)
    fill(browser, "temperature", 0)
    browser.find_element(By.ID, "top_k").clear()
    fill(browser, "system", "Be brief.")
    reference = Chat(
        model, tok, chat_template(meta), "Be brief.", SampleConfig(max_new_tokens=30, temperature=0, top_k=None)
    )
    for turn, said in enumerate(["Translate to English: Ein Hund.", "Translate to English: Eine Katze."]):
        fill(browser, "message", said)
        if turn == 0:
            browser.find_element(By.ID, "generate").click()
        else:  # Enter sends, as in any chat box
            browser.find_element(By.ID, "message").send_keys(Keys.ENTER)
        WebDriverWait(browser, 30).until(lambda b: "finished" in text_of(b, "stats"))
        expected = "".join(p.text for p in reference.say(said))  # the library, with the same history
        bubbles = browser.find_elements(By.CSS_SELECTOR, "#chat-log .message")
        assert [b.get_attribute("class").split()[-1] for b in bubbles] == ["user", "assistant"] * (turn + 1)
        assert bubbles[-2].get_attribute("textContent") == said
        assert bubbles[-1].get_attribute("textContent") == expected
    browser.execute_script('document.getElementById("generate").disabled = true')  # as while an answer streams
    fill(browser, "message", "Noch eine?")
    browser.find_element(By.ID, "message").send_keys(Keys.ENTER)
    assert len(browser.find_elements(By.CSS_SELECTOR, "#chat-log .message")) == 4  # nothing sent meanwhile
    browser.execute_script('document.getElementById("generate").disabled = false')
    browser.find_element(By.ID, "reset").click()
    assert browser.find_elements(By.CSS_SELECTOR, "#chat-log .message") == []
    assert text_of(browser, "error") == ""
